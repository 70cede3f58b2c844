"""SwiGLU reference path (CPU): ``silu(gate) * up`` computed in float64 from IEEE-composed
operations (``ieee_math``), rounded to float32 once and then to the input dtype.

Purely elementwise, so batch invariant as long as every lane rounds the same way, which the
IEEE-only construction guarantees (``F.silu`` does not: its vector body and scalar tail differ).
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.ieee_math import sigmoid64
from megatron_iso.registry import OpImpl, Profile, register


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; output in the input dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} differ")
    g = gate.double()
    return (g * sigmoid64(g) * up.double()).float().to(gate.dtype)


def _probe() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4003)
    a, b = torch.randn(2, 7, 48, generator=g) * 4
    return {"fp32": swiglu(a, b), "bf16": swiglu(a.bfloat16(), b.bfloat16())}


# CPU only: on CUDA the correctness profile runs ``activation_triton`` (the same bits in one kernel).
register(
    OpImpl(
        op="swiglu",
        impl_id="swiglu.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=swiglu,
        constants={"compute_dtype": "fp64 IEEE-composed silu * up", "output_rounding": "fp32 then input dtype"},
        probe=_probe,
    )
)
