"""RoPE reference path (CPU): one cos/sin function of absolute positions, shared by all cases.

Training, prefill and decode call :func:`rope_cos_sin` with the token's absolute position, so a
token gets the same angle bits whatever the number of tokens in the call. The angle
``position * inv_freq`` is formed in float64 (positions are exact integers there), reduced modulo
pi/2 with a two-part constant, and sin/cos come from Taylor polynomials: only correctly rounded
operations, so no dependence on ATen's vector/scalar lanes (see ``ops.common.ieee_math``).
Results are rounded to float32 once.

Layout follows HF Qwen3 / Qwen3-Next: ``cos = cat(cos(f), cos(f))`` over ``rotary_dim`` and
``x_rot * cos + rotate_half(x_rot) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` (non-interleaved
halves); a partial rotary factor rotates the first ``rotary_dim`` channels and passes the rest.
"""

from __future__ import annotations

import functools

import torch

from megatron_iso.ops.common.ieee_constants import MAX_ANGLE
from megatron_iso.ops.common.ieee_math import sincos64
from megatron_iso.registry import OpImpl, Profile, register

# inv_freq[0] = theta ** 0 = 1 exactly, so a call's largest |angle| is its largest |position|: the
# range check needs only that integer, which whoever builds the positions knows on the host.
MAX_POSITION = int(MAX_ANGLE)


def check_position(position: int, where: str = "") -> None:
    """Raise if ``|position|`` is beyond the exact angle reduction (``MAX_POSITION``); host ints only.

    ``where`` prefixes the message (e.g. which sequence of a pack). Training and rollout positions
    are checked once, where they are built (``models.batch.pack``), so no forward reads them back.
    """
    if abs(int(position)) > MAX_POSITION:
        raise ValueError(
            f"{where}position {int(position)} beyond the exact reduction range of RoPE: |position| <= {MAX_POSITION} "
            f"(angle limit {MAX_ANGLE:.10g} rad at inv_freq[0] = 1)"
        )


def inv_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / rotary_dim)`` for i < rotary_dim/2, float64, computed with Python floats.

    A function of the config only (never of a batch), so every case sees the same values.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    return torch.tensor([1.0 / (theta ** (2 * i / rotary_dim)) for i in range(rotary_dim // 2)], dtype=torch.float64)


@functools.cache
def inv_frequencies_on(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """:func:`inv_frequencies` on ``device``, cached: one host-to-device copy per (config, device), not
    one per call (on CUDA a blocking copy is a host sync). Shared; never modify it in place. Never
    evicted: a captured decode graph reads it by address (a handful of configs per process)."""
    return inv_frequencies(rotary_dim, theta).to(device)


def rotary_dim_for(head_dim: int, fraction: float = 1.0) -> int:
    """Channels rotated for a partial rotary factor (HF: ``int(head_dim * partial_rotary_factor)``)."""
    dim = int(head_dim * fraction)
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(
            f"partial rotary fraction {fraction} of head_dim {head_dim} gives {dim}; need even, 0 < d <= head_dim"
        )
    return dim


def max_abs_position(positions: torch.Tensor) -> int:
    """``max |positions|`` read back from the tensor (a host sync on GPU; 0 when empty)."""
    return int(positions.abs().max()) if positions.numel() else 0


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0, *, max_position: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, float32, shape ``[*positions.shape, rotary_dim]``, for absolute integer positions.

    ``max_position``: the caller's host bound on ``|positions|`` (``IsoBatch.max_position``); given,
    the range check uses it and the tensor is not read back.
    """
    if positions.is_floating_point():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    check_position(max_abs_position(positions) if max_position is None else max_position)
    inv = inv_frequencies_on(int(rotary_dim), float(theta), positions.device)
    angle = positions.to(torch.float64).unsqueeze(-1) * inv
    sin, cos = sincos64(angle)
    cos = torch.cat([cos, cos], dim=-1).float()
    sin = torch.cat([sin, sin], dim=-1).float()
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[tokens, heads, head_dim]``; one rounding.

    ``cos``/``sin``: ``[tokens, rotary_dim]`` float32 from :func:`rope_cos_sin`.
    """
    if x.dim() != 3 or cos.dim() != 2 or cos.shape[0] != x.shape[0]:
        raise ValueError(f"apply_rope: x [T, H, D] and cos [T, rot] expected, got {tuple(x.shape)}, {tuple(cos.shape)}")
    rot = cos.shape[-1]
    if rot > x.shape[-1] or rot % 2:
        raise ValueError(f"apply_rope: rotary_dim {rot} invalid for head_dim {x.shape[-1]}")
    xr = x[..., :rot].float()
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = xr * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


def _probe_apply() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4002)
    x = torch.randn(6, 2, 32, generator=g)
    pos = torch.tensor([0, 1, 63, 64, 4095, 131071])
    out = {}
    for frac, rd in (("full", 32), ("quarter", 8)):
        cos, sin = rope_cos_sin(pos, rd, 10000.0)
        out[f"{frac}_fp32"] = apply_rope(x, cos, sin)
        out[f"{frac}_bf16"] = apply_rope(x.bfloat16(), cos, sin)
    return out


def _probe_cos_sin() -> dict[str, torch.Tensor]:
    pos = torch.tensor([0, 1, 2, 63, 64, 65, 1000, 4095, 32767, 131071, 1000003])
    cos, sin = rope_cos_sin(pos, 64, 1_000_000.0)
    return {"cos": cos, "sin": sin}


# CPU only: on CUDA the correctness profile runs ``rope_triton`` (the same bits in one kernel each).
register(
    OpImpl(
        op="rope_cos_sin",
        impl_id="rope_cos_sin.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=rope_cos_sin,
        constants={
            "inv_freq": "fp64 python theta ** (-2i/rotary_dim)",
            "angle": "fp64 position * inv_freq",
            "sincos": "fp64 cody-waite pi/2 (2 parts) + taylor deg 17/16, rounded to fp32",
            "layout": "hf rotate_half: cat(f, f)",
        },
        probe=_probe_cos_sin,
    )
)
register(
    OpImpl(
        op="rope",
        impl_id="rope.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=apply_rope,
        constants={
            "accumulate_dtype": "fp32",
            "layout": "hf rotate_half (non-interleaved)",
            "output_rounding": "once",
        },
        probe=_probe_apply,
    )
)
