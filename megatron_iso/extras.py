"""Optional dependencies, imported lazily with an actionable error.

Transformer Engine, apex, Triton and FLA are GPU-cluster extras. The CPU path never
imports them; code that needs one calls :func:`require` at the point of use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from megatron_iso.errors import UserError

# module name -> (what it is, how to install it)
_EXTRAS: dict[str, tuple[str, str]] = {
    "transformer_engine": (
        "NVIDIA Transformer Engine",
        "pip install 'megatron_iso[te]' on a CUDA machine (or use the NVIDIA PyTorch image)",
    ),
    "apex": (
        "NVIDIA apex (not the PyPI package named 'apex')",
        "build it from https://github.com/NVIDIA/apex or use the NVIDIA PyTorch image",
    ),
    "triton": ("Triton GPU kernels", "pip install 'megatron_iso[gpu]' on a CUDA machine"),
    "fla": ("flash-linear-attention (fla-core)", "pip install 'megatron_iso[gpu]'"),
    "transformers": ("HF transformers", "pip install 'megatron_iso[hf]'"),
}


class MissingExtraError(UserError, ImportError):
    """An optional dependency needed by the requested path is not installed."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature`` or raise a :class:`MissingExtraError` naming the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        what, how = _EXTRAS.get(module, (module, f"pip install {module}"))
        raise MissingExtraError(f"{feature} needs {what} (module '{module}'), which is not installed: {how}.") from exc
