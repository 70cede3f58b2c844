"""Activations: SwiGLU (``silu(gate) * up``), plus IEEE-composed exp/sigmoid/silu in ``pointwise``.

Dispatch as in ``ops.norm``: CPU+correctness = ``reference``, CUDA+correctness =
``megatron_iso.ops.activation.activation_triton`` (lazy, same signature), performance = ``native``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_iso.contract.registry import lookup
from megatron_iso.ops.activation import native, reference  # noqa: F401  (imports register the implementations)

TRITON_MODULE = "megatron_iso.ops.activation.activation_triton"


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


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, profile: str = "correctness") -> torch.Tensor:
    """``silu(gate) * up``."""
    return _select("swiglu", "swiglu", gate, profile)(gate, up)


def swiglu_packed(x: torch.Tensor, *, profile: str = "correctness") -> torch.Tensor:
    """Megatron's fused layout: ``x = [gate | up]`` along the last dim (``torch.chunk(x, 2, -1)``)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: last dim {x.shape[-1]} is odd")
    gate, up = torch.chunk(x, 2, dim=-1)
    return swiglu(gate, up, profile=profile)


__all__ = ["swiglu", "swiglu_packed"]
