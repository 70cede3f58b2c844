"""The RL loop under faults and misuse: resume rules, identity checks, NaN policy, the run lock."""

from __future__ import annotations

import json

import pytest

from megatron_iso.errors import NonFiniteError
from megatron_iso.rl.checkpoint import CheckpointError
from megatron_iso.rl.run import TIMING_PREFIXES, train
from megatron_iso.rl.run_dir import RunDirError, RunLock
from megatron_iso.settings.compose import load_config

FAST = ["rl.group_size=4", "rl.max_response_length=4", "task.prompts_per_step=3", "rl.checkpoint_every=1"]


def _run(run_dir, *overrides):
    return train(load_config([*FAST, f"out_dir={run_dir}", *overrides]))


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_true_without_a_run_is_an_error_and_writes_nothing(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        _run(tmp_path / "typo", "rl.steps=1", "resume=true")
    assert not (tmp_path / "typo").exists()


def test_resume_auto_starts_then_continues(tmp_path):
    run = tmp_path / "run"
    _run(run, "rl.steps=1", "resume=auto")
    _run(run, "rl.steps=2", "resume=auto")
    assert _steps(run) == [0, 1]
    assert (run / "config.yaml").exists() and (run / "config.resumed_step000001.yaml").exists()


def test_resume_with_another_model_names_the_keys(tmp_path):
    run = tmp_path / "run"
    _run(run, "rl.steps=1")
    with pytest.raises(CheckpointError, match=r"model\.rope_theta: 1000000\.0 -> 10000\.0"):
        _run(run, "rl.steps=2", "resume=true", "model.rope_theta=10000.0")
    assert _steps(run) == [0]


def test_resume_rewinds_metrics_without_losing_them(tmp_path):
    run = tmp_path / "run"
    _run(run, "rl.steps=3", "rl.checkpoint_every=2")  # checkpoints after steps 1 and 2
    # Roll latest back to step 1 as if step 2's checkpoint had not been published.
    (run / "checkpoints" / "latest").write_text("step_000001")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # a torn line of a crash
    _run(run, "rl.steps=3", "resume=true")
    assert _steps(run) == [0, 1, 2]
    rewound = (run / "metrics.rewound.jsonl").read_text().splitlines()
    assert json.loads(rewound[0])["step"] == 2 and rewound[1] == '{"step": 3, "rew'


def test_nan_stops_the_run_and_no_checkpoint_holds_it(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        _run(run, "rl.steps=4", "rl.lr=1e30")
    latest = run / "checkpoints" / "latest"
    if latest.exists():  # a checkpoint written before the weights diverged is finite by construction
        from megatron_iso.checkpoint.run_ckpt import checkpoint_tensors

        for t in checkpoint_tensors(run / "checkpoints" / latest.read_text(), optimizer=True).values():
            assert bool(t.isfinite().all())


def test_nan_skip_drops_the_updates_and_counts_them(tmp_path):
    run = tmp_path / "run"
    out = _run(run, "rl.steps=3", "rl.lr=1e30", "rl.nonfinite=skip")
    skipped = [row["nonfinite/skipped"] for row in out["history"]]
    assert skipped[0] == 0.0 and sum(skipped) >= 1.0
    for row in out["history"]:
        assert all(not isinstance(v, float) or v == v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)
                   and k not in ("grad_norm", "loss"))  # fmt: skip


def test_nonfinite_policy_is_checked_before_anything_runs(tmp_path):
    from megatron_iso.settings import SettingsError

    with pytest.raises(
        SettingsError, match=r"rl.nonfinite='ignore' is not allowed; allowed values: \['stop', 'skip'\]"
    ):
        _run(tmp_path / "run", "rl.nonfinite=ignore")
    assert not (tmp_path / "run").exists()


def test_a_locked_run_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    _run(run, "rl.steps=1")
    holder = RunLock(run)
    with holder, pytest.raises(RunDirError, match="in use by another run"):
        _run(run, "rl.steps=2", "resume=true")
