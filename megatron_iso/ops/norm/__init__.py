"""RMSNorm family: plain, zero-centred (``x̂·(1+w)``) and gated (``norm(x)·silu(z)``).

One dispatch point: the device class comes from the input tensor, the profile from the caller
(``correctness`` = invariant path, ``performance`` = native). CPU+correctness is the torch
reference, CUDA+correctness the Triton kernels in ``megatron_iso.ops.norm.norm_triton`` (imported
lazily, same signatures as ``reference``), performance the native formulas on either device.
"""

from __future__ import annotations

import functools

import torch

from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.common.dispatch import select
from megatron_iso.ops.norm import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.registry import Profile

TRITON_MODULE = "megatron_iso.ops.norm.norm_triton"


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """RMSNorm over the last dim; ``zero_centered`` uses the scale ``1 + weight``."""
    fn = functools.partial(select("rmsnorm", x, profile, TRITON_MODULE), eps=eps, zero_centered=zero_centered)
    plain = functools.partial(native.rms_norm, eps=eps, zero_centered=zero_centered)
    return with_plain_backward(fn, plain, x, weight) if profile == Profile.CORRECTNESS else fn(x, weight)


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
    fn = functools.partial(select("rmsnorm_gated", x, profile, TRITON_MODULE), eps=eps, zero_centered=zero_centered)
    plain = functools.partial(native.gated_rms_norm, eps=eps, zero_centered=zero_centered)
    return with_plain_backward(fn, plain, x, gate, weight) if profile == Profile.CORRECTNESS else fn(x, gate, weight)


__all__ = ["gated_rms_norm", "rms_norm"]
