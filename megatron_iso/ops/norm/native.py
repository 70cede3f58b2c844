"""RMSNorm native path: the formulas stock stacks (HF transformers Qwen3 / Qwen3-Next) use.

``torch.mean`` and ``torch.rsqrt`` let ATen pick vectorisation and reduction order per shape, and
intermediate results are rounded to the input dtype where HF rounds them. This is the baseline the
reference path is measured against, and the performance profile's implementation.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_iso.registry import Profile, register_per_device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, zero_centered: bool = False) -> torch.Tensor:
    """HF-style RMSNorm; ``zero_centered`` follows Qwen3-Next (scale in fp32, then cast)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, zero_centered: bool = False
) -> torch.Tensor:
    """Qwen3-Next-style gated RMSNorm: normalise, scale in the input dtype, multiply by fp32 silu(gate)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = (1.0 + weight.float()).to(x.dtype) if zero_centered else weight
    y = w * y.to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def _probe_inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Seeded on the CPU generator so the inputs are the same bits for every device class.
    g = torch.Generator().manual_seed(4001)
    x, z, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g) * 0.1
    return x.to(device), z.to(device), w.to(device)


def _probe_rms_norm(device: str = "cpu") -> dict[str, torch.Tensor]:
    x, _, w = _probe_inputs(device)
    return {"fp32": rms_norm(x, w), "bf16": rms_norm(x.bfloat16(), w.bfloat16())}


def _probe_gated(device: str = "cpu") -> dict[str, torch.Tensor]:
    x, z, w = _probe_inputs(device)
    return {"fp32": gated_rms_norm(x, z, w), "bf16": gated_rms_norm(x.bfloat16(), z.bfloat16(), w.bfloat16())}


register_per_device(
    op="rmsnorm",
    impl_id="rmsnorm.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=rms_norm,
    constants={"formula": "hf: x.float() * rsqrt(mean(x^2) + eps); weight * y.to(dtype)"},
    probe_for=lambda device: functools.partial(_probe_rms_norm, device),
)
register_per_device(
    op="rmsnorm_gated",
    impl_id="rmsnorm_gated.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=gated_rms_norm,
    constants={"formula": "hf qwen3-next: weight * y.to(dtype) * silu(gate.float())"},
    probe_for=lambda device: functools.partial(_probe_gated, device),
)
