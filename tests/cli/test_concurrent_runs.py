"""Two real iso-train processes on one out_dir at once: one runs to completion, the other is refused by the run
directory's lock (``rl.run_dir.RunLock``, ``<out_dir>/.lock``) with exit 2 and one line, and metrics.jsonl holds
every step exactly once.

The second run must meet the lock, not the "already holds a run" check that comes before it: the loop plans the
start (which refuses a directory holding metrics) before it builds the run and takes the lock. So the first run
is frozen (SIGSTOP) as soon as it holds the lock and before it logs its first step, whatever the machine's speed;
the second then runs against the held lock; the first is resumed (SIGCONT) and finishes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAST = ["rl.group_size=2", "rl.max_response_length=2", "task.prompts_per_step=2", "logger=none", "rl.steps=3"]
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="freezes the first run with SIGSTOP")


def _start(run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    with log.open("wb") as out:  # a file, not a pipe: a frozen or chatty child can never block on it
        return subprocess.Popen(
            [sys.executable, "-m", "megatron_iso.cli.train", *FAST, f"out_dir={run_dir}"],
            cwd=log.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _frozen_holding_the_lock(proc: subprocess.Popen[bytes], run_dir: Path) -> bool:
    """Wait until ``proc`` holds the run's lock, then freeze it; False when it got past its first step first
    (its metrics exist) or ended: the window was missed and the attempt must start over."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (run_dir / ".lock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    return proc.poll() is None and not (run_dir / "metrics.jsonl").exists()


def test_a_second_run_on_a_locked_out_dir_is_refused_and_the_first_completes(tmp_path):
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        first = _start(run_dir, tmp_path / f"first{attempt}.log")
        try:
            frozen = _frozen_holding_the_lock(first, run_dir)
            if frozen:
                second = subprocess.run(
                    [sys.executable, "-m", "megatron_iso.cli.train", *FAST, f"out_dir={run_dir}"],
                    cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
                    capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                )  # fmt: skip
        finally:
            if first.poll() is None:
                os.kill(first.pid, signal.SIGCONT)
            try:
                first_rc = first.wait(timeout=TIMEOUT_S)
            finally:
                if first.poll() is None:
                    first.kill()
        first_log = (tmp_path / f"first{attempt}.log").read_text(errors="replace")
        if frozen:
            break
    else:
        pytest.fail(f"the first run never held the lock before its first step (3 attempts):\n{first_log[-3000:]}")

    assert second.returncode == 2, second.stderr[-3000:]
    lines = [line for line in second.stderr.splitlines() if line.startswith("iso-train:")]
    lock = re.escape(str(run_dir / ".lock"))
    assert len(lines) == 1, second.stderr[-3000:]
    assert re.search(rf"out_dir=.*{re.escape(run_dir.name)} is in use by another run \(lock {lock}\)", lines[0])
    assert "Traceback" not in second.stderr

    assert first_rc == 0, first_log[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert steps == [0, 1, 2]
