"""SwiGLU native path: ``F.silu(gate) * up`` in the input dtype (Megatron's unfused SwiGLU)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_iso.registry import Profile, register_per_device


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``, each op rounded to the input dtype."""
    return F.silu(gate) * up


def _probe(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4003)
    a, b = (torch.randn(2, 7, 48, generator=g) * 4).to(device)
    return {"fp32": swiglu(a, b), "bf16": swiglu(a.bfloat16(), b.bfloat16())}


register_per_device(
    op="swiglu",
    impl_id="swiglu.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=swiglu,
    constants={"formula": "F.silu(gate) * up in input dtype"},
    probe_for=lambda device: functools.partial(_probe, device),
)
