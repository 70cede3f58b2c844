"""RMSNorm family: plain, zero-centred (``x̂·(1+w)``) and gated (``norm(x)·silu(z)``).

One dispatch point: the device class comes from the input tensor, the profile from the caller
(``correctness`` = invariant path, ``performance`` = native). CPU+correctness is the torch
reference, CUDA+correctness the Triton kernels in ``megatron_iso.ops.norm.norm_triton`` (imported
lazily), performance the native formulas on either device; each answers the Protocols of ``backend``.
Backward (correctness): on CUDA one Triton pass (``norm_backward_triton``), on the CPU autograd of
the native formula.
"""

from __future__ import annotations

import functools

import torch

from megatron_iso.ops.common.autograd import with_fused_backward, with_plain_backward
from megatron_iso.ops.common.dispatch import select
from megatron_iso.ops.norm import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.norm.backend import GatedRMSNorm, RMSNorm
from megatron_iso.registry import Profile

TRITON_MODULE = "megatron_iso.ops.norm.norm_triton"


def _backward_kernels():
    """The GPU backward kernels (imported lazily: Triton is optional on the CPU path)."""
    from megatron_iso.ops.norm import norm_backward_triton

    return norm_backward_triton


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """RMSNorm over the last dim; ``zero_centered`` uses the scale ``1 + weight``."""
    impl: RMSNorm = select("rmsnorm", x, profile, TRITON_MODULE)
    fn = functools.partial(impl, eps=eps, zero_centered=zero_centered)
    if profile != Profile.CORRECTNESS:
        return fn(x, weight)
    if x.is_cuda:
        bwd = functools.partial(_backward_kernels().rms_norm_backward, eps=eps, zero_centered=zero_centered)
        return with_fused_backward(fn, bwd, x, weight)
    plain = functools.partial(native.rms_norm, eps=eps, zero_centered=zero_centered)
    return with_plain_backward(fn, plain, x, weight)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """``rms_norm(x) * silu(gate)`` over the last dim."""
    impl: GatedRMSNorm = select("rmsnorm_gated", x, profile, TRITON_MODULE)
    fn = functools.partial(impl, eps=eps, zero_centered=zero_centered)
    if profile != Profile.CORRECTNESS:
        return fn(x, gate, weight)
    if x.is_cuda:
        bwd = functools.partial(_backward_kernels().gated_rms_norm_backward, eps=eps, zero_centered=zero_centered)
        return with_fused_backward(fn, bwd, x, gate, weight)
    plain = functools.partial(native.gated_rms_norm, eps=eps, zero_centered=zero_centered)
    return with_plain_backward(fn, plain, x, gate, weight)


__all__ = ["gated_rms_norm", "rms_norm"]
