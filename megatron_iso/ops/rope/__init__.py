"""Rotary position embedding: full or partial (first ``rotary_dim`` channels), HF ``rotate_half`` layout.

Dispatch as in ``ops.norm``: CPU+correctness = ``reference``, CUDA+correctness =
``megatron_iso.ops.rope.rope_triton`` (lazy, same signatures), performance = ``native``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_iso.contract.registry import lookup
from megatron_iso.ops.rope import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.rope.reference import inv_frequencies, rotary_dim_for

TRITON_MODULE = "megatron_iso.ops.rope.rope_triton"


def _select(op: str, fn_name: str, t: torch.Tensor, profile: str) -> Callable[..., Any]:
    """The registered implementation for (op, device class of ``t``, profile).

    The Triton module is imported only on demand (it needs triton and a GPU); importing it registers
    its cuda/correctness entries. Fallback for a module that does not register: its function named
    ``fn_name`` or ``fn_name + "_triton"``.
    """
    device_class = "cuda" if t.device.type == "cuda" else "cpu"
    if device_class == "cuda" and profile == "correctness":
        try:
            module = importlib.import_module(TRITON_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name != TRITON_MODULE:
                raise
            raise NotImplementedError(
                f"{op} on cuda/correctness needs {TRITON_MODULE} (function {fn_name}), not written yet"
            ) from exc
        try:
            return lookup(op, device_class, profile).fn
        except KeyError:
            fn = getattr(module, fn_name, None) or getattr(module, f"{fn_name}_triton", None)
            if fn is None:
                raise NotImplementedError(
                    f"{TRITON_MODULE} neither registers op {op!r} (cuda, correctness) nor defines {fn_name}"
                ) from None
            return fn
    return lookup(op, device_class, profile).fn


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0, *, profile: str = "correctness"
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` of shape ``[*positions.shape, rotary_dim]`` for absolute integer positions."""
    return _select("rope_cos_sin", "rope_cos_sin", positions, profile)(positions, rotary_dim, theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, profile: str = "correctness") -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]``'s first ``cos.shape[-1]`` channels."""
    return _select("rope", "apply_rope", x, profile)(x, cos, sin)


__all__ = ["apply_rope", "inv_frequencies", "rope_cos_sin", "rotary_dim_for"]
