"""A checkpoint the disk refuses (full, over quota, or over the process's file size limit) stops the run with one line
naming the checkpoint and the reason (exit 2), and leaves no half-written step directory behind."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_refused_checkpoint_write_is_one_line_and_leaves_nothing(tmp_path):
    def file_size_limit() -> None:  # torch's writer then sees a short write (Python ignores SIGXFSZ: EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-m", "megatron_iso.cli.train", "rl.steps=2", "rl.checkpoint_every=1", f"out_dir={run}"],
        env=env, capture_output=True, text=True, preexec_fn=file_size_limit, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("iso-train: error: step 0: writing checkpoint ") and "file size limit" in last, last
    assert "Traceback" not in res.stderr
    assert not any((run / "checkpoints").glob("step_*")), sorted((run / "checkpoints").iterdir())
