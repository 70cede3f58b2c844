"""RoPE native path: HF transformers' formulas (fp32 inv_freq and angles, cos/sin cast to the
input dtype, rotation evaluated in the input dtype). Baseline and performance-profile path."""

from __future__ import annotations

import functools

import torch

from megatron_iso.registry import Profile, register_per_device


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0, *, max_position: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``RotaryEmbedding``: fp32 ``inv_freq``, fp32 angles, ``torch.cos``/``torch.sin``.

    ``max_position`` is accepted for the dispatch's common signature and unused: the fp32 formula
    has no exact range to check (HF does not check either)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` with partial rotary, in the input dtype; ``x`` is ``[T, H, D]``."""
    rot = cos.shape[-1]
    cos = cos.to(x.dtype).unsqueeze(1)
    sin = sin.to(x.dtype).unsqueeze(1)
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def _probe(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4002)
    x = torch.randn(6, 2, 32, generator=g).to(device)
    pos = torch.tensor([0, 1, 63, 64, 4095, 131071], device=device)
    cos, sin = rope_cos_sin(pos, 8, 10000.0)
    return {
        "cos": cos,
        "sin": sin,
        "quarter_fp32": apply_rope(x, cos, sin),
        "quarter_bf16": apply_rope(x.bfloat16(), cos, sin),
    }


register_per_device(
    op="rope_cos_sin",
    impl_id="rope_cos_sin.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=rope_cos_sin,
    constants={"formula": "hf: fp32 inv_freq, fp32 angle, torch.cos/sin"},
)
register_per_device(
    op="rope",
    impl_id="rope.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=apply_rope,
    constants={"formula": "hf apply_rotary_pos_emb in input dtype"},
    probe_for=lambda device: functools.partial(_probe, device),
)
