"""Rollout in another layout than the trainer (trainer TP=2, rollout TP=1 on each of 2 gloo ranks):
weights synced after every step, zero mismatch, the same run as the colocated one; refusals."""

from __future__ import annotations

import pytest

from megatron_iso.rl.run import TIMING_PREFIXES, train
from megatron_iso.settings.compose import load_config
from megatron_iso.testing.harness import run_on_ranks

FAST = ["rl.group_size=4", "rl.max_response_length=4", "task.prompts_per_step=3", "rl.steps=2"]


def _train(out_dir: str, overrides: list[str]) -> list[dict]:
    return train(load_config([*FAST, f"out_dir={out_dir}", *overrides]))["history"]


def _refusal(out_dir: str, overrides: list[str]) -> str:
    from megatron_iso.contract import ContractMismatchError

    try:
        _train(out_dir, overrides)
    except ContractMismatchError as exc:
        return str(exc)
    return "not refused"


def _computed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)} for row in history]


def test_rollout_tp1_under_trainer_tp2_has_zero_mismatch_and_matches_colocated(tmp_path):
    split = run_on_ranks(_train, 2, tp=2, args=(str(tmp_path / "split"), ["parallel.tp=2", "rollout.parallel.tp=1"]))
    colocated = run_on_ranks(_train, 2, tp=2, args=(str(tmp_path / "colocated"), ["parallel.tp=2"]))
    rows = split[0]
    assert len(rows) == 2
    # The step-0 update moved the weights: a rollout model left unsynced would now disagree.
    assert rows[0]["grad_norm"] > 0
    for r in rows:
        assert r["mismatch/abs_diff_max"] == 0.0
        assert r["mismatch/bitwise_equal_frac"] == 1.0
    assert _computed(split[0]) == _computed(split[1])  # both trainer TP ranks log the same step
    # Rollout TP is a deployment knob: the same samples, logprobs, rewards, loss and update.
    assert _computed(split[0]) == _computed(colocated[0])


def test_performance_profile_refuses_a_different_rollout_layout(tmp_path):
    out = tmp_path / "perf"
    messages = run_on_ranks(
        _refusal, 2, tp=2, args=(str(out), ["profile=performance", "parallel.tp=2", "rollout.parallel.tp=1"])
    )
    for m in messages:
        assert "contract mismatch with rollout layout (rollout.parallel)" in m
        assert "first differing field numerical_policy.claims.axes.tp.value: local=2" in m
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.parallel.tp=2", r"rollout.parallel.tp=2 must divide the world size 1; allowed values: \[1\]"),
        ("+rollout.parallel.pp=2", r"unknown key rollout.parallel.pp=2; did you mean rollout.parallel.tp\?"),
    ],
)
def test_bad_rollout_layout_is_a_clear_error(tmp_path, override, message):
    from megatron_iso.errors import UserError  # the unknown key: the schema's SettingsError; the rest: RunSetupError

    with pytest.raises(UserError, match=message):
        _train(str(tmp_path / "bad"), [override])
    assert not (tmp_path / "bad").exists()
