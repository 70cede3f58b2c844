"""SwiGLU / RoPE Triton kernels and their float64 helpers under TRITON_INTERPRET=1, bit for bit
against the torch references (skipped without triton).

Under the interpreter numpy evaluates every float64 operation (IEEE, correctly rounded, no FMA), so
equality with the CPU reference checks that the kernels perform the reference's operation sequence
with its constants; the GPU run (tests/gpu/test_ieee_math_triton.py) adds the compiler and hardware.
The checks themselves live in ieee_math_triton_interpret_check.py, shared with the GPU test.
"""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

CHECK = pathlib.Path(__file__).with_name("ieee_math_triton_interpret_check.py")


def test_ieee_math_kernels_bitwise_under_interpreter():
    res = run_interpreted(script=CHECK, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
