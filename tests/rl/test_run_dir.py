"""Run-directory rules: explicit resume modes, the exclusive lock, metrics never lost, identity diffs, and the
new directory of a run without out_dir."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from megatron_iso.rl.run_dir import (
    REWOUND_FILE,
    RunDirError,
    RunLock,
    default_run_dir,
    identity_diff,
    locked_start,
    new_run_name,
    plan_start,
    rewind_metrics,
)
from megatron_iso.settings import SettingsError, check_out_dir, resume_mode
from megatron_iso.testing.harness import run_on_ranks


def _metrics(run_dir, steps, torn: str | None = None):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in steps)
    (run_dir / "metrics.jsonl").write_text(text + (torn or ""))


@pytest.mark.parametrize(("value", "mode"), [(True, "true"), (False, "false"), ("auto", "auto"), ("AUTO", "auto")])
def test_resume_mode_accepts_booleans_and_auto(value, mode):
    assert resume_mode(value) == mode


def test_resume_mode_names_the_allowed_values():
    with pytest.raises(
        SettingsError, match=r"resume='yes' is not allowed; allowed values: \['false', 'true', 'auto'\]"
    ):
        resume_mode("yes")


def test_new_run_refuses_a_directory_that_holds_one(tmp_path):
    _metrics(tmp_path / "run", [0])
    with pytest.raises(RunDirError, match="already holds a run"):
        plan_start(tmp_path / "run", "false", None)
    assert plan_start(tmp_path / "fresh", "false", None) is None


def test_resume_true_with_nothing_to_resume_is_an_error(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        plan_start(tmp_path / "typo", "true", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="holds no checkpoint"):
        plan_start(tmp_path / "empty", "true", None)


def test_auto_starts_or_continues(tmp_path):
    assert plan_start(tmp_path / "new", "auto", None) is None
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert plan_start(tmp_path / "run", "auto", ckpt) == ckpt
    assert plan_start(tmp_path / "run", "true", ckpt) == ckpt


@pytest.mark.parametrize("mode", ["true", "auto"])
def test_metrics_without_checkpoint_are_never_overwritten(tmp_path, mode):
    _metrics(tmp_path / "run", [0, 1])
    with pytest.raises(RunDirError, match="no complete checkpoint"):
        plan_start(tmp_path / "run", mode, None)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_rewind_moves_recomputed_steps_and_a_torn_line_aside(tmp_path):
    run = tmp_path / "run"
    _metrics(run, [0, 1, 2, 3], torn='{"step": 4, "rew')
    assert rewind_metrics(run, 2) == 2
    kept = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1]
    moved = (run / REWOUND_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved[:2]] == [2, 3]
    assert moved[2] == '{"step": 4, "rew'


def test_rewind_refuses_a_damaged_line_before_the_last(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(RunDirError, match="line 2 is not a metrics record"):
        rewind_metrics(run, 1)
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\nnot json\n{"step": 1}\n'


_HOLD = """
import sys, time
from pathlib import Path
from megatron_iso.rl.run_dir import RunLock
with RunLock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(30)
"""


def test_a_second_process_cannot_take_the_run_lock(tmp_path):
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match="is in use by another run"), RunLock(run):
            pass
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 10
    while True:  # the OS drops the lock with the process
        try:
            with RunLock(run):
                break
        except RunDirError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _lock_is_held(run: Path) -> bool:
    """Whether some open file holds the run lock (flock: another open file of this process conflicts too)."""
    import fcntl
    import os

    fd = os.open(run / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_the_start_is_decided_under_the_run_lock(tmp_path):
    run = tmp_path / "run"
    assert plan_start(run, "false", None) is None  # the early check: the directory is free
    _metrics(run, [0, 1])  # meanwhile another run wrote there, and ended (its lock released)
    (run / "config.yaml").write_text("the other run's\n")
    seen = []

    def plan() -> Path | None:
        seen.append(_lock_is_held(run))
        return plan_start(run, "false", None)

    with pytest.raises(RunDirError, match="already holds a run"), locked_start(run, plan):
        pytest.fail("a refused start runs nothing")
    assert seen == [True]
    assert (run / "config.yaml").read_text() == "the other run's\n"
    assert not _lock_is_held(run)  # released with the refusal
    ckpt = run / "checkpoints" / "step_000001"
    with locked_start(run, lambda: ckpt) as resume_from:  # resume=auto/true: continue what is there
        assert resume_from == ckpt and _lock_is_held(run)
    assert not _lock_is_held(run)


def test_a_run_that_wrote_while_this_one_was_built_is_not_overwritten(tmp_path, monkeypatch):
    """The race: the early check passes on a free out_dir, another run writes there (and ends) while this one
    builds its model; the start decided under the lock refuses, and config.yaml stays the other run's."""
    import megatron_iso.rl.run as run_module
    from megatron_iso.settings.compose import load_config

    run = tmp_path / "run"

    class OtherRunMeanwhile(run_module.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _metrics(run, [0])
            (run / "config.yaml").write_text("the other run's\n")

    monkeypatch.setattr(run_module, "Trainer", OtherRunMeanwhile)
    fast = ["rl.steps=1", "rl.group_size=2", "rl.max_response_length=2", "task.prompts_per_step=2", "logger=none"]
    with pytest.raises(RunDirError, match="already holds a run"):
        run_module.train(load_config([*fast, f"out_dir={run}"]))
    assert (run / "config.yaml").read_text() == "the other run's\n"
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml", "metrics.jsonl"]


def _rank_locked_start(root: str, refuse: bool) -> str:
    import torch.distributed as dist

    def plan() -> Path | None:
        assert dist.get_rank() == 0, "only rank 0 plans"
        if refuse:
            raise RunDirError("out_dir=x already holds a run")
        return Path(root) / "checkpoints" / "step_000003"

    try:
        with locked_start(Path(root), plan, dist.get_rank()) as resume_from:
            return str(resume_from)
    except RunDirError as exc:
        return f"refused: {exc}"


def test_every_rank_gets_rank_0s_start_or_refusal(tmp_path):
    got = run_on_ranks(_rank_locked_start, 2, args=(str(tmp_path), False), timeout=120)
    assert got == [str(tmp_path / "checkpoints" / "step_000003")] * 2
    got = run_on_ranks(_rank_locked_start, 2, args=(str(tmp_path), True), timeout=120)
    assert got == [
        "refused: out_dir=x already holds a run",
        "refused: rank 0 refused to start: out_dir=x already holds a run",
    ]


def test_identity_diff_names_nested_keys():
    saved = {"model": {"rope_theta": 1e6, "hidden": 64}, "task": {"name": "residue"}}
    now = {"model": {"rope_theta": 1e4, "hidden": 64}, "task": {"name": "residue", "extra": 1}}
    assert identity_diff(saved, now) == ["model.rope_theta: 1000000.0 -> 10000.0", "task.extra: '<absent>' -> 1"]
    assert identity_diff(saved, saved) == []


def test_a_default_run_name_is_the_utc_start_time_and_a_random_id():
    east = timezone(timedelta(hours=9))
    assert new_run_name(datetime(2026, 12, 4, 7, 15, 0, tzinfo=east), "3fa2c1") == "20261203-221500-3fa2c1"
    a, b = new_run_name(), new_run_name()
    assert a != b and a[:15] <= b[:15]


def test_a_default_run_dir_is_new(tmp_path, monkeypatch):
    import megatron_iso.rl.run_dir as run_dir

    names = iter(["20261203-221500-aaaaaa", "20261203-221500-aaaaaa", "20261203-221500-bbbbbb"])
    monkeypatch.setattr(run_dir, "new_run_name", lambda: next(names))
    (tmp_path / "20261203-221500-aaaaaa").mkdir()
    assert default_run_dir(tmp_path) == tmp_path / "20261203-221500-bbbbbb"


def _rank_run_dir(root: str) -> str:
    import time

    import torch.distributed as dist

    time.sleep(1.1 * dist.get_rank())  # ranks start at different times: their own names would differ
    return str(default_run_dir(Path(root)))


def test_every_rank_of_a_launch_gets_rank_0s_run_dir(tmp_path):
    dirs = run_on_ranks(_rank_run_dir, 2, args=(str(tmp_path),), timeout=120)
    assert dirs[0] == dirs[1] and Path(dirs[0]).parent == tmp_path


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_out_dir_is_refused(value):
    with pytest.raises(SettingsError, match=r"out_dir=.* is not allowed; allowed values: a directory path, or null"):
        check_out_dir(value)
    assert check_out_dir(None) is None and check_out_dir("runs/a") == Path("runs/a")
