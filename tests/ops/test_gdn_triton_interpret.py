"""The GDN Triton kernels on CPU under TRITON_INTERPRET=1 (tiny shapes; skipped without triton).

The checks live in ``gdn_triton_interpret_check.py`` (see its docstring) and run in a subprocess,
because TRITON_INTERPRET must be set before triton is first imported. What the interpreter shows: the
kernels' logic (segments, chunk buffer, resync, chains, state writes, conv history) and the CPR
invariance of their structure; the interpreter's dot is numpy's matmul, so the GPU bits are checked by
tests/gpu/test_gdn_triton.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted


def test_gdn_triton_kernels_under_interpreter():
    res = run_interpreted(script=Path(__file__).with_name("gdn_triton_interpret_check.py"), timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "grad ok" in res.stdout, out[-4000:]
