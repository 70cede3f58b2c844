"""Triton kernels on the CPU under ``TRITON_INTERPRET=1``: the one place for the interpreter's workaround
and for running a check in a child process (the variable must be set before triton is first imported).

- :func:`allow_runtime_loop_bounds`: triton 3.6's interpreter cannot loop to a run-time bound with numpy
  2.x (``int()`` of a 1-element array); give the interpreter's tensors an ``__index__``. Call it in the
  interpreted process before the first launch.
- :func:`fuse_interpreted_fma`: make the interpreter's ``tl.fma`` round once, as the GPU's does, for fp32
  (the interpreter computes ``x * y + z`` in two roundings).
- :func:`skip_autotune_benchmarks`: ``triton.autotune`` times its configs through the GPU driver's benchmarker,
  which the interpreter has none of; let it take its first config untimed (any config computes the same function).
- :func:`tensor_loop_indices`: compiled Triton makes the index of a plain ``for i in range(n)`` loop a tensor, and
  kernels call ``i.to(...)`` on it (FLA's ``chunk_delta_h``); the interpreter runs Python's ``range`` (ints). Give a
  kernel module a ``range`` that yields interpreter scalars.
- :func:`run_interpreted`: run ``python -c SOURCE`` or ``python SCRIPT [ARGS]`` with the interpreter on.
- :func:`run_interpreted_concurrently`: one such child per argument list, all at once (the interpreter is
  single-threaded Python, so children of a long check share the cores instead of queueing on one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np


def allow_runtime_loop_bounds() -> None:
    """Patch the interpreter's tensor type so a run-time loop bound converts to int."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` rounded once to fp32 (IEEE fma, ties to even) for fp32 arrays: the product is exact in
    fp64; the fp64 sum's rounding error (TwoSum) decides the one case where rounding the fp64 sum to fp32
    could go the other way, a sum that lands exactly on a midpoint between two fp32 neighbours."""
    a64, b64, c64 = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        y = s.astype(np.float32)
        down, up = np.nextafter(y, np.float32(-np.inf)), np.nextafter(y, np.float32(np.inf))
        y64 = y.astype(np.float64)
        below = (s == (y64 + down.astype(np.float64)) / 2) & (err < 0)
        above = (s == (y64 + up.astype(np.float64)) / 2) & (err > 0)
        exact = np.where(below, down, np.where(above, up, y))
    return np.where(np.isfinite(s) & np.isfinite(err), exact, y).astype(np.float32)


def fuse_interpreted_fma() -> None:
    """Patch the interpreter's fp32 ``tl.fma`` to :func:`fma_f32` (other dtypes keep the interpreter's form)."""
    import triton.runtime.interpreter as interp

    orig = interp.InterpreterBuilder.create_fma

    def fused(self, x, y, z):
        if z.data.dtype != np.float32:
            return orig(self, x, y, z)
        return interp.TensorHandle(fma_f32(x.data, y.data, z.data), z.dtype.scalar)

    interp.InterpreterBuilder.create_fma = fused


def skip_autotune_benchmarks() -> None:
    """Patch ``triton.autotune`` so it picks its first config without timing (the interpreter has no benchmarker)."""
    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles: [0.0] * len(quantiles))


def tensor_loop_indices(module: Any) -> None:
    """Make ``range`` in ``module``'s kernels yield interpreter int32 scalars, as compiled Triton's loop indices are.
    Only for modules whose host code uses no ``range`` of its own (the scalars convert to int, but cost more)."""
    import builtins

    import triton.language as tl
    import triton.runtime.interpreter as interp

    def tensor_range(*bounds: Any) -> Iterator[Any]:
        for i in builtins.range(*(int(b) for b in bounds)):
            yield tl.core.tensor(interp.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

    module.range = tensor_range


def run_interpreted(
    source: str | None = None,
    *,
    script: Path | None = None,
    args: Sequence[str] = (),
    timeout: float,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """A child Python with ``TRITON_INTERPRET=1`` running ``source`` (``-c``) or ``script`` with ``args``; output
    captured. ``env``: extra variables for the child."""
    if (source is None) == (script is None):
        raise ValueError("run_interpreted: give exactly one of source= or script=")
    argv = [sys.executable, "-c", source] if source is not None else [sys.executable, str(script)]
    child_env = dict(os.environ, **(env or {}), TRITON_INTERPRET="1")
    return subprocess.run([*argv, *args], env=child_env, capture_output=True, text=True, timeout=timeout)


def run_interpreted_concurrently(
    script: Path, arg_lists: Sequence[Sequence[str]], *, timeout: float
) -> list[subprocess.CompletedProcess]:
    """``script`` once per argument list, the children all running at once, each on one intra-op thread (they
    share the cores); results in the order of ``arg_lists``. ``timeout`` is each child's."""
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with ThreadPoolExecutor(max_workers=len(arg_lists)) as pool:
        jobs = [
            pool.submit(run_interpreted, script=script, args=list(a), timeout=timeout, env=one_thread)
            for a in arg_lists
        ]
        return [j.result() for j in jobs]
