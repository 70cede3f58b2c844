"""The trainer's optimizer and learning-rate schedule (rl.optim): Megatron's scheduler driven by the rl
settings, one step per RL step, positioned by step count on resume; the defaults keep the optimizer's own
learning rate and weight decay; iso-train logs the rate each step used."""

from __future__ import annotations

import json
import os

import pytest

from megatron_iso.testing.cli_process import run_python
from megatron_iso.testing.harness import run_on_ranks

COSINE = ["rl.steps=4", "rl.lr_warmup_steps=1", "rl.lr_decay_style=cosine", "rl.min_lr=0.002"]
# warmup from 0 to rl.lr (0.02) at step 1, then cosine to min_lr at step 4
COSINE_LRS = [0.0, 0.02, 0.002 + 0.75 * 0.018, 0.002 + 0.25 * 0.018]


def _groups(optimizer) -> list[tuple[float, float, float]]:
    return [(g["lr"], g["weight_decay"], g.get("wd_mult", 1.0)) for g in optimizer.param_groups]


def _schedules(overrides: list[str]):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.rl.optim import build_optimizer, current_lr
    from megatron_iso.settings import resolve
    from megatron_iso.settings.compose import load_config

    cfg = load_config(["model=tiny_dense", *overrides])
    rl = resolve(cfg).rl
    tc = transformer_config(cfg)
    model = build_model(tc, random_hf_state_dict(tc, seed=1))
    ddp, optimizer, schedule = build_optimizer(tc, model, rl)
    lrs, groups = [], []
    for _ in range(rl.steps):
        lrs.append(current_lr(optimizer))
        groups.append(_groups(optimizer))
        schedule.step(1)
    _, resumed_opt, resumed = build_optimizer(tc, build_model(tc, random_hf_state_dict(tc, seed=1)), rl)
    resumed.step(2)  # a run resumed at step 2
    plain = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=rl.lr, clip_grad=rl.grad_clip), [ddp])
    return {"lrs": lrs, "groups": groups, "resumed_at_2": _groups(resumed_opt), "plain": _groups(plain)}


def test_cosine_schedule_with_warmup_and_resume_position():
    out = run_on_ranks(_schedules, 1, args=(COSINE,))[0]
    assert out["lrs"] == pytest.approx(COSINE_LRS, abs=1e-12)
    assert out["resumed_at_2"] == out["groups"][2]  # advanced by the step count: the same rates and decays


def test_default_schedule_keeps_the_rate_and_applies_the_no_decay_groups():
    out = run_on_ranks(_schedules, 1, args=(["rl.steps=3"],))[0]
    assert out["lrs"] == [0.02] * 3
    # Megatron's Adam groups hold the configured decay and a wd_mult (0 for norms and biases) that only the
    # scheduler applies: with it, those parameters are not decayed.
    want = [(lr, wd * mult, mult) for lr, wd, mult in out["plain"]]
    assert any(mult == 0.0 for _, _, mult in want) and all(g == want for g in out["groups"])


def test_iso_train_logs_each_steps_learning_rate(tmp_path):
    run = tmp_path / "run"
    args = ["rl.group_size=2", "rl.max_response_length=2", "task.prompts_per_step=2", "logger=none", f"out_dir={run}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    # forked (testing.cli_process), not a fresh interpreter: its own process without 6-8 s of imports
    proc = run_python(["-m", "megatron_iso.cli.train", *args, *COSINE], cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["optim/lr"] for m in lines] == pytest.approx(COSINE_LRS, abs=1e-12)
