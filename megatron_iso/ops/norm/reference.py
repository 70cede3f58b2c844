"""RMSNorm reference path (CPU): invariant by construction.

Each row's mean of squares is a fixed-tree sum (``tree_sum_dim``) in float32, so a row's bits never
depend on how many other rows share the call. Only correctly rounded elementwise ops follow
(``sqrt``, ``/``, ``*``, and the IEEE-composed silu from ``ops.common.ieee_math``), and the output
is rounded to the input dtype once, at the end.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.ieee_math import iso_silu
from megatron_iso.ops.common.tree import tree_sum_dim
from megatron_iso.registry import OpImpl, Profile, register

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm: unsupported dtype {x.dtype}; supported {SUPPORTED_DTYPES}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != (hidden,) = {tuple(x.shape[-1:])}")


def _normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * 1/sqrt(mean(x^2) + eps) in float32; the mean is the tree sum divided by n."""
    xf = x.float()
    n = torch.tensor(float(x.shape[-1]), dtype=torch.float32, device=x.device)
    eps_t = torch.tensor(eps, dtype=torch.float32, device=x.device)
    ms = tree_sum_dim(xf * xf, -1) / n
    # 1/sqrt rather than rsqrt: both sqrt and division are correctly rounded in every lane.
    inv = 1.0 / torch.sqrt(ms + eps_t)
    return xf * inv.unsqueeze(-1)


def _scale(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    w = weight.float()
    # Zero-centred weights (Qwen3-Next) store w with the effective scale 1 + w, formed in float32.
    return 1.0 + w if zero_centered else w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim: ``x̂ * w`` (or ``x̂ * (1 + w)`` if ``zero_centered``)."""
    _check(x, weight)
    return (_normalize_fp32(x, eps) * _scale(weight, zero_centered)).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, zero_centered: bool = False
) -> torch.Tensor:
    """Gated RMSNorm (Qwen3-Next linear attention output): ``rms_norm(x) * silu(gate)``, one rounding."""
    _check(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    y = _normalize_fp32(x, eps) * _scale(weight, zero_centered)
    return (y * iso_silu(gate)).to(x.dtype)


def _probe_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4001)
    x = torch.randn(5, 96, generator=g)
    z = torch.randn(5, 96, generator=g)
    w = torch.randn(96, generator=g) * 0.1
    return x, z, w


def _probe_rms_norm() -> dict[str, torch.Tensor]:
    x, _, w = _probe_inputs()
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[f"plain_{name}"] = rms_norm(x.to(dt), w.to(dt), 1e-6)
        out[f"zero_centered_{name}"] = rms_norm(x.to(dt), w.to(dt), 1e-6, zero_centered=True)
    return out


def _probe_gated() -> dict[str, torch.Tensor]:
    x, z, w = _probe_inputs()
    return {
        name: gated_rms_norm(x.to(dt), z.to(dt), w.to(dt), 1e-6)
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }


_CONSTANTS = {
    "accumulate_dtype": "fp32",
    "reduction": "tree_sum_dim(x*x) / n",
    "eps": "added in fp32 to the mean of squares, then 1/sqrt",
    "zero_centered_scale": "fp32 1 + w",
    "output_rounding": "once, to input dtype",
}
REFERENCE_RMSNORM = register(
    OpImpl(
        op="rmsnorm",
        impl_id="rmsnorm.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=rms_norm,
        constants=_CONSTANTS,
        probe=_probe_rms_norm,
    )
)
REFERENCE_GATED_RMSNORM = register(
    OpImpl(
        op="rmsnorm_gated",
        impl_id="rmsnorm_gated.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=gated_rms_norm,
        constants={**_CONSTANTS, "silu": "fp64 IEEE-composed (ieee_math.iso_silu), rounded to fp32"},
        probe=_probe_gated,
    )
)
