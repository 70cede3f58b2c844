"""Whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``), read once at import.

Kernels take it as a constexpr where the interpreter cannot follow the compiled code (inline PTX, Gluon) or where
tiny test shapes want smaller tiles; ``megatron_iso.testing.triton_interpret`` starts the interpreted children."""

from __future__ import annotations

import os

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["INTERPRET"]
