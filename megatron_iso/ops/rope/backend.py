"""The RoPE family's backend signatures: what ``reference``, ``native`` and ``rope_triton`` each answer."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_iso.ops.common.signatures import Signature


class RopeCosSin(Protocol):
    """op ``rope_cos_sin``: integer positions ``[*P]`` -> fp32 ``(cos, sin)``, each ``[*P, rotary_dim]``.
    ``max_position``: a host bound on ``|positions|``, so the range check reads nothing back."""

    def __call__(
        self, positions: torch.Tensor, rotary_dim: int, theta: float = ..., *, max_position: int | None = ...
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ApplyRope(Protocol):
    """op ``rope``: x ``[T, H, D]``, cos/sin ``[T, rot]`` -> ``[T, H, D]`` in x's dtype, first ``rot`` channels
    rotated (HF ``rotate_half`` layout), the rest passed through."""

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


SIGNATURES = (Signature("rope_cos_sin", RopeCosSin), Signature("rope", ApplyRope))
