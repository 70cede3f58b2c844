"""RMSNorm family: plain, zero-centred (``x̂·(1+w)``) and gated (``norm(x)·silu(z)``).

One dispatch point: the device class comes from the input tensor, the profile from the caller
(``correctness`` = invariant path, ``performance`` = native). CPU+correctness is the torch
reference, CUDA+correctness the Triton kernels in ``megatron_iso.ops.norm.norm_triton`` (imported
lazily, same signatures as ``reference``), performance the native formulas on either device.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.dispatch import select
from megatron_iso.ops.norm import native, reference  # noqa: F401  (imports register the implementations)

TRITON_MODULE = "megatron_iso.ops.norm.norm_triton"


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    profile: str = "correctness",
) -> torch.Tensor:
    """RMSNorm over the last dim; ``zero_centered`` uses the scale ``1 + weight``."""
    return select("rmsnorm", x, profile, TRITON_MODULE)(x, weight, eps, zero_centered=zero_centered)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    profile: str = "correctness",
) -> torch.Tensor:
    """``rms_norm(x) * silu(gate)`` over the last dim."""
    return select("rmsnorm_gated", x, profile, TRITON_MODULE)(x, gate, weight, eps, zero_centered=zero_centered)


__all__ = ["gated_rms_norm", "rms_norm"]
