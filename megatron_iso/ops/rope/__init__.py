"""Rotary position embedding: full or partial (first ``rotary_dim`` channels), HF ``rotate_half`` layout.

Dispatch as in ``ops.norm``: CPU+correctness = ``reference``, CUDA+correctness =
``megatron_iso.ops.rope.rope_triton`` (lazy), performance = ``native``; each answers the Protocols of ``backend``.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.common.dispatch import select
from megatron_iso.ops.rope import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.rope.backend import ApplyRope, RopeCosSin
from megatron_iso.ops.rope.reference import MAX_POSITION, check_position, inv_frequencies, rotary_dim_for
from megatron_iso.registry import Profile

TRITON_MODULE = "megatron_iso.ops.rope.rope_triton"


def rope_cos_sin(
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float = 10000.0,
    *,
    profile: str = Profile.CORRECTNESS,
    max_position: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` of shape ``[*positions.shape, rotary_dim]`` for absolute integer positions.

    ``max_position``: a host bound on ``|positions|`` (``IsoBatch.max_position``, from ``pack``); with
    it the correctness profile's range check reads nothing back from the device."""
    fn: RopeCosSin = select("rope_cos_sin", positions, profile, TRITON_MODULE)
    return fn(positions, rotary_dim, theta, max_position=max_position)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, profile: str = Profile.CORRECTNESS
) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]``'s first ``cos.shape[-1]`` channels."""
    fn: ApplyRope = select("rope", x, profile, TRITON_MODULE)
    return (
        with_plain_backward(fn, native.apply_rope, x, cos, sin) if profile == Profile.CORRECTNESS else fn(x, cos, sin)
    )


__all__ = [
    "MAX_POSITION",
    "TRITON_MODULE",
    "apply_rope",
    "check_position",
    "inv_frequencies",
    "rope_cos_sin",
    "rotary_dim_for",
]
