"""The RMSNorm family's backend signatures: what ``reference``, ``native`` and ``norm_triton`` each answer."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_iso.ops.common.signatures import Signature


class RMSNorm(Protocol):
    """op ``rmsnorm``: x ``[..., H]``, weight ``[H]`` -> ``[..., H]`` in x's dtype; scale ``1 + weight`` if zero-centred."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, zero_centered: bool = ...
    ) -> torch.Tensor: ...


class GatedRMSNorm(Protocol):
    """op ``rmsnorm_gated``: ``rms_norm(x) * silu(gate)``; x and gate ``[..., H]``, weight ``[H]`` -> ``[..., H]``."""

    def __call__(
        self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, zero_centered: bool = ...
    ) -> torch.Tensor: ...


SIGNATURES = (Signature("rmsnorm", RMSNorm), Signature("rmsnorm_gated", GatedRMSNorm))
