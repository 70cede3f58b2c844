"""rl.ppo_mini_batch_size / rl.ppo_epochs: several optimizer steps per rollout batch, pi_old from the rollout in the
correctness profile (bit for bit a recompute) and recomputed in the performance profile."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_iso.parallel.world import seed_ranks
from megatron_iso.rl.losses import group_advantages
from megatron_iso.rl.ppo import (
    mini_batch_count,
    old_logprob_source,
    recompute_old_logprobs,
    run_updates,
    schedule_line,
    split_groups,
)
from megatron_iso.rl.run import train
from megatron_iso.rl.trainer import Trainer
from megatron_iso.settings import SettingsError, check_config, config_world, resolve
from megatron_iso.settings.compose import load_config
from megatron_iso.testing.bits import bits

GROUP = 4
FAST = ["model=tiny_dense", f"rl.group_size={GROUP}", "rl.max_response_length=5", "task.prompts_per_step=2"]


def _trainer(tmp_path, overrides: list[str]) -> tuple[Trainer, list, torch.Tensor]:
    cfg = load_config([*FAST, f"out_dir={tmp_path / 'run'}", *overrides])
    seed_ranks(int(cfg.seed))
    trainer = Trainer(resolve(cfg), 0)
    samples = trainer.rollout(0)
    rewards = trainer.score_rewards(samples)
    return trainer, samples, group_advantages(rewards, GROUP)


def test_rollout_logprobs_equal_a_recompute_bit_for_bit(tmp_path):
    """The correctness profile's pi_old: the rollout's logprobs are what the skipped forward would give."""
    with config_world(load_config(FAST)):
        trainer, samples, _ = _trainer(tmp_path, ["rl.ppo_mini_batch_size=1", "rl.train_micro_batch_seqs=3"])
        assert trainer.ppo_schedule == (2, "rollout")  # no recompute forward is planned
        recompute_old_logprobs(trainer, samples, samples[0])
        for s in samples:
            assert torch.equal(bits(s.old_logp), bits(torch.tensor(s.rollout_logp, dtype=torch.float32)))


def test_clip_binds_on_the_second_mini_batch_and_mask_drops_nothing(tmp_path, monkeypatch):
    overrides = ["rl.ppo_mini_batch_size=1", "rl.lr=0.5", "rl.rollout_correction.mode=mask"]
    with config_world(load_config(FAST)):
        trainer, samples, adv = _trainer(tmp_path, overrides)

        def no_forward(*args):
            raise AssertionError("the correctness profile spent a forward on pi_old")

        monkeypatch.setattr("megatron_iso.rl.ppo.recompute_old_logprobs", no_forward)  # the exact step's saving
        outs = run_updates(trainer, samples, adv, passes=1, filler=samples[0])
    assert len(outs) == 2
    # The first update scores the rollout's weights: every PPO ratio is exactly 1. The second scores the
    # weights the first update moved, against pi_old: the clip binds.
    assert outs[0]["policy/clip_frac"] == 0.0
    assert outs[1]["policy/clip_frac"] > 0.0
    for out in outs:  # the correctness profile: pi_old / pi_rollout is exactly 1
        assert out["rollout_correction/masked_frac"] == 0.0 and out["rollout_correction/weight_mean"] == 1.0
    assert torch.equal(bits(outs[0]["trainer_logp"]), bits(outs[0]["rollout_logp"]))
    assert int(outs[0]["trained_lengths"].sum()) == outs[0]["trainer_logp"].numel()
    assert "timing/old_logp_s" not in outs[0]


def test_ppo_run_logs_its_updates(tmp_path):
    overrides = ["rl.steps=1", "rl.ppo_mini_batch_size=1", "rl.ppo_epochs=2", f"out_dir={tmp_path / 'run'}"]
    history = train(load_config([*FAST, *overrides]))["history"]
    step = history[0]
    assert step["ppo/updates"] == 4.0  # 2 mini-batches x 2 epochs
    assert step["mismatch/abs_diff_max"] == 0.0 and step["mismatch/bitwise_equal_frac"] == 1.0


def test_old_logprob_source_and_schedule_checks():
    def rl(size=0, epochs=1, recompute="auto", mode="off"):
        keys = {"ppo_mini_batch_size": size, "ppo_epochs": epochs, "recompute_old_logprobs": recompute,
                "rollout_correction.mode": mode}  # fmt: skip
        return resolve(load_config([f"rl.{k}={v}" for k, v in keys.items()])).rl

    assert old_logprob_source(rl(), bitwise=False, updates=1) == "forward"  # today's step
    assert old_logprob_source(rl(), bitwise=True, updates=1) == "forward"
    assert old_logprob_source(rl(epochs=2), bitwise=True, updates=2) == "rollout"
    assert old_logprob_source(rl(epochs=2), bitwise=False, updates=2) == "recompute"
    assert old_logprob_source(rl(mode="mask"), bitwise=False, updates=1) == "recompute"
    assert old_logprob_source(rl(mode="mask"), bitwise=True, updates=1) == "rollout"
    assert old_logprob_source(rl(recompute="true"), bitwise=True, updates=1) == "recompute"
    assert old_logprob_source(rl(epochs=2, recompute="false"), bitwise=False, updates=2) == "rollout"
    assert mini_batch_count(rl(size=2), 8) == 4 and mini_batch_count(rl(), 8) == 1
    with pytest.raises(SettingsError, match=r"rl.ppo_mini_batch_size=3 does not divide task.prompts_per_step=8; .*"
                       r"divisor of 8: \[1, 2, 4, 8\]$"):  # fmt: skip
        mini_batch_count(rl(size=3), 8)
    with pytest.raises(SettingsError, match=r"rl.ppo_mini_batch_size=3 does not divide task.prompts_per_step=4"):
        check_config(load_config(["rl.ppo_mini_batch_size=3", "task.prompts_per_step=4"]))  # before any run starts
    with pytest.raises(ValueError, match=r"rl.recompute_old_logprobs='sometimes' .*\['auto', 'true', 'false'\]"):
        rl(recompute="sometimes")
    with pytest.raises(ValueError, match=r"rl.ppo_mini_batch_size=-1 .*prompts per optimizer step"):
        rl(size=-1)


def test_split_groups_keeps_groups_whole():
    samples = [types.SimpleNamespace(i=i) for i in range(10)]  # 5 groups of 2
    chunks = split_groups(samples, torch.arange(10.0), 2, 3)
    assert [[s.i for s in c] for c, _ in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [a.tolist() for _, a in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [len(c) for c, _ in split_groups(samples[:2], torch.zeros(2), 2, 3)] == [2, 0, 0]


def test_performance_profile_recomputes_pi_old_once(tmp_path, monkeypatch):
    overrides = ["profile=performance", "rl.ppo_mini_batch_size=1", "rl.ppo_epochs=2"]
    with config_world(load_config([*FAST, "profile=performance"])):
        trainer, samples, adv = _trainer(tmp_path, overrides)
        assert trainer.ppo_schedule == (2, "recompute")
        calls = []
        real = recompute_old_logprobs

        def counted(*args):
            calls.append(1)
            return real(*args)

        monkeypatch.setattr("megatron_iso.rl.ppo.recompute_old_logprobs", counted)
        outs = run_updates(trainer, samples, adv, passes=1, filler=samples[0])
    assert len(calls) == 1 and len(outs) == 4
    assert outs[0]["timing/old_logp_s"] > 0 and all("timing/old_logp_s" not in o for o in outs[1:])  # its cost
    # The step's mismatch covers every sample, scored by the recompute at the rollout's weights.
    assert (
        outs[0]["trainer_logp"].numel() == sum(len(s.tokens) for s in samples) == int(outs[0]["trained_lengths"].sum())
    )
    assert all(s.old_logp is not None for s in samples)


def test_a_step_that_trains_nothing_says_why(tmp_path, capsys):
    """DAPO's dynamic sampling dropping every group: no update, no loss, and one line on stderr naming the cause."""
    cfg = load_config([*FAST, "rl=dapo", f"out_dir={tmp_path / 'run'}"])
    with config_world(cfg):
        seed_ranks(int(cfg.seed))
        trainer = Trainer(resolve(cfg), 0)
        trainer.task.reward = lambda prompt, tokens: 1.0  # every group all right: none informative
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        metrics = trainer.step(0)
    assert "loss" not in metrics and metrics["samples/kept_frac"] == 0.0
    err = capsys.readouterr().err
    # rl=dapo re-samples up to rl.max_gen_batches=4 batches of 2 groups before it gives up on the step
    assert (
        "step 0: no update: dynamic sampling (rl.dynamic_sampling) dropped all 8 groups of 4 generation batches "
        "(rl.max_gen_batches=4; every sample of each group got the same reward), so the step trains nothing and logs "
        "no loss; rl.max_gen_batches=5 or more re-samples further before giving up\n" in err
    )
    assert metrics["samples/gen_batches"] == 4.0
    for n, p in trainer.model.named_parameters():
        assert torch.equal(bits(p.detach()), bits(before[n])), n


def test_schedule_line_says_where_pi_old_comes_from():
    def line(profile: str, overrides: list[str]) -> str | None:
        settings = resolve(load_config([f"profile={profile}", "task.prompts_per_step=4", *overrides]))
        fake = types.SimpleNamespace(rl=settings.rl, task=settings.task, settings=settings)
        count = mini_batch_count(settings.rl, 4)
        fake.ppo_schedule = (
            count,
            old_logprob_source(settings.rl, settings.profile.bitwise, count * settings.rl.ppo_epochs),
        )
        return schedule_line(fake)

    assert line("correctness", []) is None  # the default step: nothing to say
    assert line("correctness", ["rl.ppo_mini_batch_size=2", "rl.ppo_epochs=2"]) == (
        "ppo: 4 optimizer steps per RL step (2 mini-batches of 2 prompts x 2 epochs); pi_old: the rollout's "
        "logprobs, no forward spent (bit for bit the trainer's in the correctness profile)"
    )
    assert line("performance", ["rl.rollout_correction.mode=mask", "rl.rollout_correction.upper=4"]) == (
        "ppo: 1 optimizer step per RL step (1 mini-batch of 4 prompts x 1 epoch); pi_old: one no-grad trainer "
        "forward before the first update (timing/old_logp_s); rollout correction: mask at token level, band [0.25, 4]"
    )
    warned = line("performance", ["rl.ppo_epochs=2", "rl.recompute_old_logprobs=false"])
    assert warned is not None and warned.endswith(
        "(rl.recompute_old_logprobs=false: NOT the trainer's in this profile)"
    )
