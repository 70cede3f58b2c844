"""The activation family's backend signature: what ``reference``, ``native`` and ``activation_triton`` answer."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_iso.ops.common.signatures import Signature


class SwiGLU(Protocol):
    """op ``swiglu``: ``silu(gate) * up``; gate and up ``[..., F]`` (views allowed) -> ``[..., F]`` in their dtype."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...


SIGNATURES = (Signature("swiglu", SwiGLU),)
