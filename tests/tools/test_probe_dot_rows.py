"""tools/probe_dot_rows.py under the Triton interpreter: every check runs and reports, and the properties that hold
for numpy's matmul too hold here (a row's bits do not follow other rows of A, nor B's rows past a triangular cut;
our prep kernel's rows < n do not follow the chunk's later rows). Position, tile size and K padding do move numpy's bits, so
those are only required to be reported (the GPU answer: docs/GDN.md, "Design sketch")."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "probe_dot_rows.py"


def test_probe_runs_and_rows_keep_their_bits_where_numpy_does(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    checks = {(r["check"].split(" (")[0].split(" n=")[0], r["prec"]) for r in rows}
    for prec in ("ieee", "tf32", "tf32x3", "bf16"):
        for check in ("other_rows", "zero_rows", "b_rows_beyond_cut", "position", "tile_m", "warps", "k_padding"):
            assert (check, prec) in checks, (check, prec)
    for prec in ("ieee", "tf32x3", "tf32"):
        assert ("prep_partial U0", prec) in checks and ("prep_partial W", prec) in checks
    must_hold = ("other_rows", "zero_rows", "b_rows_beyond_cut", "prep_partial")
    broken = [r for r in rows if r["check"].startswith(must_hold) and r["rows_differing"]]
    assert not broken, broken
