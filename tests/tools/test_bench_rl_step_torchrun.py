"""tools/bench_rl_step.py under ``torchrun --nproc-per-node 2`` with ``parallel.tp=2`` (gloo CPU
ranks here; the same command runs NCCL ranks on two GPUs): both profiles run in one world of the
config's layout, rank 0 alone writes the report, and the iso profile's mismatch is exactly zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU run; on GPUs docs/PERFORMANCE.md's command runs it")
def test_bench_rl_step_tp2_under_torchrun(tmp_path):
    out = tmp_path / "rl_step_tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(REPO / "tools" / "bench_rl_step.py"), "--steps", "2", "--prompts", "2", "--group", "2"]
    cmd += ["--new-tokens", "4", "--kv-cache-mb", "8", "--out", str(out), "parallel.tp=2", "parallel.sp=true"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["failures"] == {} and report["device"] == "2 x cpu"
    by = {r["profile"]: r for r in report["results"]}
    assert set(by) == {"correctness", "performance"}
    for r in by.values():
        assert (r["world_size"], r["tp"], r["dp"]) == (2, 2, 1), r["profile"]
        assert len(r["steps"]) == 2 and r["step_s"] > 0
    iso = by["correctness"]
    assert iso["mismatch_max"] == 0.0 and iso["bitwise_equal_frac"] == 1.0
    assert proc.stdout.count("| correctness |") == 1  # one table: rank 0's
