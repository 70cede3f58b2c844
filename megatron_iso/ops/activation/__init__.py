"""Activations: SwiGLU (``silu(gate) * up``), plus IEEE-composed exp/sigmoid/silu in ``ieee_math``.

Dispatch as in ``ops.norm``: CPU+correctness = ``reference``, CUDA+correctness =
``megatron_iso.ops.activation.activation_triton`` (lazy), performance = ``native``; each answers ``backend.SwiGLU``.
Backward (correctness): on CUDA one Triton pass; on the CPU autograd of the native formula.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.activation import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.activation.backend import SwiGLU
from megatron_iso.ops.common.autograd import with_fused_backward, with_plain_backward
from megatron_iso.ops.common.dispatch import select
from megatron_iso.registry import Profile

TRITON_MODULE = "megatron_iso.ops.activation.activation_triton"


def _backward_kernels():
    """The GPU backward kernels (lazy: Triton is optional on the CPU path)."""
    from megatron_iso.ops.activation import activation_triton

    return activation_triton


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, profile: str = Profile.CORRECTNESS) -> torch.Tensor:
    """``silu(gate) * up``."""
    fn: SwiGLU = select("swiglu", gate, profile, TRITON_MODULE)
    if profile != Profile.CORRECTNESS:
        return fn(gate, up)
    if gate.is_cuda:
        return with_fused_backward(fn, _backward_kernels().swiglu_backward, gate, up)
    return with_plain_backward(fn, native.swiglu, gate, up)


def swiglu_packed(x: torch.Tensor, *, profile: str = Profile.CORRECTNESS) -> torch.Tensor:
    """Megatron's fused layout: ``x = [gate | up]`` along the last dim (``torch.chunk(x, 2, -1)``).

    The halves are views, so on CUDA the one SwiGLU kernel reads them in place; output in ``x.dtype``.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: last dim {x.shape[-1]} is odd")
    if x.is_cuda and profile == Profile.CORRECTNESS:
        # One autograd node over x: the backward writes both halves' gradients into one buffer.
        fn: SwiGLU = select("swiglu", x, profile, TRITON_MODULE)
        return with_fused_backward(
            lambda t: fn(*torch.chunk(t, 2, dim=-1)), _backward_kernels().swiglu_packed_backward, x
        )
    gate, up = torch.chunk(x, 2, dim=-1)
    return swiglu(gate, up, profile=profile)


__all__ = ["TRITON_MODULE", "swiglu", "swiglu_packed"]
