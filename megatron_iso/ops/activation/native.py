"""SwiGLU native path: ``F.silu(gate) * up`` in the input dtype (Megatron's unfused SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_iso.contract.registry import OpImpl, register


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``, each op rounded to the input dtype."""
    return F.silu(gate) * up


for _dev in ("cpu", "cuda"):
    register(
        OpImpl(
            op="swiglu",
            impl_id="swiglu.native",
            version="1",
            device_class=_dev,
            profile="performance",
            fn=swiglu,
            constants={"formula": "F.silu(gate) * up in input dtype"},
        )
    )
