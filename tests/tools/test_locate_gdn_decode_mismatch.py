"""tools/locate_gdn_decode_mismatch.py under the Triton interpreter (tiny shapes): a clean run reports no differing
step, and an output moved by one ulp on decode steps from a given position is reported at that step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--device", "cpu", "--chunk", "4", "--dim", "8", "--heads", "1", "2", "--dot-precision", "ieee", "--steps", "9"]
# the rule with every one-token call from position 6 on returning its output one ulp up (a planted decode defect)
PLANTED = """
import sys, torch
sys.path.insert(0, "tools")
from megatron_iso.ops.gdn.triton import rule as gt
import locate_gdn_decode_mismatch as tool
rule = gt.gated_delta_rule
def moved(*a, starts=None, **kw):
    out = rule(*a, starts=starts, **kw)
    if a[0].shape[0] == 1 and starts is not None and int(starts[0]) >= 6:
        out = torch.nextafter(out, torch.full_like(out, float("inf")))
    return out
gt.gated_delta_rule = moved
sys.exit(tool.main(sys.argv[1:]))
"""


def _run(cmd: list[str], out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([*cmd, *ARGS, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    return res, json.loads(out.read_text()) if out.exists() else {}


def test_clean_rule_reports_no_differing_step(tmp_path: Path) -> None:
    res, got = _run([sys.executable, "tools/locate_gdn_decode_mismatch.py"], tmp_path / "m.json")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert got["summary"] == {"steps": 9, "differing_steps": 0, "first": None}
    # steps inside a chunk compare the cache rows; a step that closes its chunk (L = 3, 7) the entry state
    assert {"u_rows", "y_rows", "tinv_diag_rows"} <= set(got["rows"][0]) and "entry_state" in got["rows"][2]


def test_a_decode_output_off_by_one_ulp_is_located(tmp_path: Path) -> None:
    res, got = _run([sys.executable, "-c", PLANTED], tmp_path / "m.json")
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert got["summary"]["first"] == {"L": 6, "t": 2, "differs": ["output"]}
    assert got["summary"]["differing_steps"] == 4  # L = 6..9
    assert "L=   6 t=  2 differs: output" in res.stdout
