"""RMSNorm family: plain, zero-centred (``x̂·(1+w)``) and gated (``norm(x)·silu(z)``).

One dispatch point: the device class comes from the input tensor, the profile from the caller
(``correctness`` = invariant path, ``performance`` = native). CPU+correctness is the torch
reference, CUDA+correctness the Triton kernels in ``megatron_iso.ops.norm.norm_triton`` (imported
lazily, same signatures as ``reference``), performance the native formulas on either device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_iso.contract.registry import lookup
from megatron_iso.ops.norm import native, reference  # noqa: F401  (imports register the implementations)

TRITON_MODULE = "megatron_iso.ops.norm.norm_triton"


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


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered: bool = False,
    profile: str = "correctness",
) -> torch.Tensor:
    """RMSNorm over the last dim; ``zero_centered`` uses the scale ``1 + weight``."""
    return _select("rmsnorm", "rms_norm", x, profile)(x, weight, eps, zero_centered=zero_centered)


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
    return _select("rmsnorm_gated", "gated_rms_norm", x, profile)(x, gate, weight, eps, zero_centered=zero_centered)


__all__ = ["gated_rms_norm", "rms_norm"]
