"""The GDN Triton kernels on CPU under TRITON_INTERPRET=1 (tiny shapes; skipped without triton).

The checks live in ``gdn_triton_interpret_check.py`` (see its docstring) and run in subprocesses,
because TRITON_INTERPRET must be set before triton is first imported. What the interpreter shows: the
kernels' logic (segments, chunk buffer, resync, chains, state writes, conv history) and the CPR
invariance of their structure; the interpreter's dot is numpy's matmul, so the GPU bits are checked by
tests/gpu/test_gdn_triton.py.

The check's parts run in three concurrent children (each form's rule checks, then everything else: about
4, 5 and 3 minutes of one core each), so the test takes about as long as its longest child on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted, run_interpreted_concurrently

SCRIPT = Path(__file__).with_name("gdn_triton_interpret_check.py")
CARRY_SCRIPT = Path(__file__).with_name("gdn_triton_carry_check.py")
GROUPS = (("scan",), ("chunk",), ("bf16_storage", "conv", "gates", "grads"))


def test_gdn_triton_kernels_under_interpreter():
    results = run_interpreted_concurrently(SCRIPT, GROUPS, timeout=900)
    for parts, res in zip(GROUPS, results, strict=True):
        want = "parts ok: " + " ".join(parts)
        assert res.returncode == 0 and want in res.stdout, f"parts {parts}:\n" + (res.stdout + res.stderr)[-4000:]


def test_gdn_triton_carry_under_interpreter():
    """The carried rule (``ops.gdn.triton.carry``): cut calls == one call bitwise per form, exits == the state cache's
    entry, gradients (the entry's included) vs the reference carry (gdn_triton_carry_check.py's docstring)."""
    res = run_interpreted(script=CARRY_SCRIPT, timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and "carry parts ok" in res.stdout, (res.stdout + res.stderr)[-4000:]


def test_every_part_of_the_check_is_run():
    """GROUPS covers the script's PARTS exactly once (a part added to the script but not here would never run)."""
    import ast

    tree = ast.parse(SCRIPT.read_text())
    parts = next(
        [k.value for k in node.value.keys]
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PARTS"
    )
    assert sorted(p for g in GROUPS for p in g) == sorted(parts)
