"""The one dispatch rule every op family uses: (op, device class of the input, profile) -> the
registered implementation.

On CUDA with the correctness profile the family's Triton module (if it has one) is imported
first, lazily: it needs triton and a GPU, and importing it registers its cuda/correctness
entries. What runs is therefore always what the registry — and so the contract — says runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_iso.extras import require
from megatron_iso.registry import Profile, lookup


def device_class_of(t: torch.Tensor) -> str:
    return "cuda" if t.device.type == "cuda" else "cpu"


def import_triton_module(module: str, feature: str) -> Any:
    """Import a family's Triton module; a missing Triton install or module is a clear error."""
    require("triton", feature)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise NotImplementedError(f"{feature} needs {module}, which is not written yet") from exc
        raise


def runs_triton(device_class: str, profile: str) -> bool:
    """Whether a family with a Triton module runs it: on cuda with the correctness profile."""
    return device_class == "cuda" and profile == Profile.CORRECTNESS


def select(op: str, t: torch.Tensor, profile: str, triton_module: str | None = None) -> Callable[..., Any]:
    """The implementation of ``op`` for ``t``'s device class and ``profile``."""
    device_class = device_class_of(t)
    if runs_triton(device_class, profile) and triton_module is not None:
        import_triton_module(triton_module, f"{op} on cuda with profile=correctness")
    return lookup(op, device_class, profile).fn
