"""The RL loop end to end on CPU: zero mismatch in the correctness profile, exact resume, refusals."""

from __future__ import annotations

import json

import pytest

from megatron_iso.rl.checkpoint import CheckpointError
from megatron_iso.rl.run import TIMING_PREFIXES, train
from megatron_iso.rl.run_dir import RunDirError
from megatron_iso.settings.compose import load_config

FAST = ["rl.group_size=4", "rl.max_response_length=4", "task.prompts_per_step=3", "rl.checkpoint_every=2"]


def _run(tmp_path, name, *overrides):
    cfg = load_config([*FAST, f"out_dir={tmp_path / name}", *overrides])
    return train(cfg)


def _metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _computed(row):
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def test_grpo_run_has_zero_mismatch_and_logs_every_step(tmp_path):
    out = _run(tmp_path, "iso", "rl.steps=3")
    rows = _metrics(tmp_path / "iso")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/abs_diff_max"] == 0.0
        assert r["mismatch/bitwise_equal_frac"] == 1.0
        assert r["mismatch/clip_frac"] == 0.0
        for key in ("reward/mean", "loss", "timing/gen_s", "timing/train_s", "timing/step_s", "mismatch/k3_kl",
                    "mismatch/abs_diff_p99", "throughput/gen_tokens_per_s", "memory/peak_bytes"):  # fmt: skip
            assert key in r
    assert (tmp_path / "iso" / "dashboard.png").stat().st_size > 0
    assert out["steps_run"] == 3


def test_one_leaf_deployment_keeps_zero_mismatch(tmp_path):
    """``profile.leaves=1 profile.tp_domain=[1]``: the row-parallel GEMMs and the vocab scoring run one leaf (for a
    deployment that never shards over TP); rollout and trainer still agree bit for bit, under that contract."""
    _run(tmp_path, "one_leaf", "rl.steps=2", "profile.leaves=1", "profile.tp_domain=[1]")
    rows = _metrics(tmp_path / "one_leaf")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["mismatch/abs_diff_max"] == 0.0 and r["mismatch/bitwise_equal_frac"] == 1.0 for r in rows)
    from megatron_iso.settings import contract_for

    meta = json.loads((tmp_path / "one_leaf" / "checkpoints" / "step_000001" / "meta.json").read_text())
    one_leaf = contract_for(load_config([*FAST, "profile.leaves=1", "profile.tp_domain=[1]"]))
    default = contract_for(load_config(FAST))
    assert meta["contract"]["numerical_policy"] == one_leaf.identities.numerical_policy
    assert one_leaf.identities.numerical_policy != default.identities.numerical_policy


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    _run(tmp_path, "full", "rl.steps=4")
    _run(tmp_path, "cut", "rl.steps=2")
    _run(tmp_path, "cut", "rl.steps=4", "resume=true")
    full, cut = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3]
    assert [_computed(r) for r in full] == [_computed(r) for r in cut]
    for name in ("worst_tokens.jsonl", "dlogp_hist.jsonl"):  # the per-token logs continue exactly as well
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name


def test_refuses_to_overwrite_or_resume_under_another_contract(tmp_path):
    _run(tmp_path, "run", "rl.steps=2")
    with pytest.raises(RunDirError, match="already holds a run"):
        _run(tmp_path, "run", "rl.steps=2")
    with pytest.raises(CheckpointError, match="numerical_policy"):
        _run(tmp_path, "run", "rl.steps=3", "resume=true", "profile=performance")
    assert [r["step"] for r in _metrics(tmp_path / "run")] == [0, 1]  # nothing overwritten


def test_dapo_run_applies_dynamic_sampling(tmp_path):
    _run(tmp_path, "dapo", "rl=dapo", "rl.steps=2")
    rows = _metrics(tmp_path / "dapo")
    assert all(0.0 <= r["samples/kept_frac"] <= 1.0 for r in rows)
    assert all(r["mismatch/abs_diff_max"] == 0.0 for r in rows)


def test_kl_to_the_initial_policy_is_logged_and_grows_from_zero(tmp_path):
    _run(tmp_path, "kl", "rl.steps=2", "rl.kl_coef=0.1")
    rows = _metrics(tmp_path / "kl")
    assert rows[0]["kl/ref_k3"] == 0.0  # step 0: policy == reference, bit for bit
    assert rows[1]["kl/ref_k3"] > 0.0
    assert all(r["mismatch/abs_diff_max"] == 0.0 for r in rows)
