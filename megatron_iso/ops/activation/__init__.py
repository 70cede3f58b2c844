"""Activations: SwiGLU (``silu(gate) * up``), plus IEEE-composed exp/sigmoid/silu in ``ieee_math``.

Dispatch as in ``ops.norm``: CPU+correctness = ``reference``, CUDA+correctness =
``megatron_iso.ops.activation.activation_triton`` (lazy, same signature), performance = ``native``.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.activation import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.common.dispatch import select
from megatron_iso.registry import Profile

TRITON_MODULE = "megatron_iso.ops.activation.activation_triton"


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, profile: str = Profile.CORRECTNESS) -> torch.Tensor:
    """``silu(gate) * up``."""
    fn = select("swiglu", gate, profile, TRITON_MODULE)
    return with_plain_backward(fn, native.swiglu, gate, up) if profile == Profile.CORRECTNESS else fn(gate, up)


def swiglu_packed(x: torch.Tensor, *, profile: str = Profile.CORRECTNESS) -> torch.Tensor:
    """Megatron's fused layout: ``x = [gate | up]`` along the last dim (``torch.chunk(x, 2, -1)``).

    The halves are views, so on CUDA the one SwiGLU kernel reads them in place; output in ``x.dtype``.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: last dim {x.shape[-1]} is odd")
    gate, up = torch.chunk(x, 2, dim=-1)
    return swiglu(gate, up, profile=profile)


__all__ = ["TRITON_MODULE", "swiglu", "swiglu_packed"]
