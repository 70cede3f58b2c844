"""Triton kernels on the CPU under ``TRITON_INTERPRET=1``: the one place for the interpreter's workaround
and for running a check in a child process (the variable must be set before triton is first imported).

- :func:`allow_runtime_loop_bounds`: triton 3.6's interpreter cannot loop to a run-time bound with numpy
  2.x (``int()`` of a 1-element array); give the interpreter's tensors an ``__index__``. Call it in the
  interpreted process before the first launch.
- :func:`run_interpreted`: run ``python -c SOURCE`` or ``python SCRIPT`` with the interpreter on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def allow_runtime_loop_bounds() -> None:
    """Patch the interpreter's tensor type so a run-time loop bound converts to int."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def run_interpreted(
    source: str | None = None, *, script: Path | None = None, timeout: float
) -> subprocess.CompletedProcess:
    """A child Python with ``TRITON_INTERPRET=1`` running ``source`` (``-c``) or ``script``; output captured."""
    if (source is None) == (script is None):
        raise ValueError("run_interpreted: give exactly one of source= or script=")
    argv = [sys.executable, "-c", source] if source is not None else [sys.executable, str(script)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
