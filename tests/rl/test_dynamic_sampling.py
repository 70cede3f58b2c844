"""DAPO dynamic sampling's re-sampling (``rl.max_gen_batches``): more batches until the step's groups are full."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.parallel.world import seed_ranks
from megatron_iso.rl.trainer import Trainer
from megatron_iso.settings import SettingsError, config_world, resolve
from megatron_iso.settings.compose import load_config

GROUP = 4
FAST = ["model=tiny_dense", "rl=dapo", f"rl.group_size={GROUP}", "rl.max_response_length=3", "task.prompts_per_step=3"]


def _step(tmp_path, informative: list[list[bool]], cap: int):
    """One DAPO step where generation batch ``d``'s group ``g`` is informative iff ``informative[d][g]`` (its
    rewards alternate 0, 1; else all 1). Returns the step's metrics, the batches' prompts and the trained
    samples' prompts in training order."""
    cfg = load_config([*FAST, f"rl.max_gen_batches={cap}", f"out_dir={tmp_path / 'run'}"])
    with config_world(cfg):
        seed_ranks(int(cfg.seed))
        trainer = Trainer(resolve(cfg), 0)
        prompts, trained = [], []
        rollout, train_on = trainer.rollout, trainer.train_on

        def tracked_rollout(step, draw=0):
            samples = rollout(step, draw)
            prompts.append([s.prompt.ids for s in samples[::GROUP]])
            for i, s in enumerate(samples):
                s.meta = (draw, s.group, i % 2)
            return samples

        def tracked_train_on(samples, advantages, **kw):
            trained.append([(s.group, s.prompt.ids) for s in samples])
            return train_on(samples, advantages, **kw)

        def reward(sample_draw_group_parity):
            draw, group, parity = sample_draw_group_parity
            return float(parity) if informative[draw][group] else 1.0

        trainer.rollout, trainer.train_on = tracked_rollout, tracked_train_on
        trainer.score_rewards = lambda samples: _score(samples, reward)
        metrics = trainer.step(0)
    return metrics, prompts, trained


def _score(samples, reward):
    for s in samples:
        s.reward = reward(s.meta)
    return torch.tensor([s.reward for s in samples])


def test_resampling_fills_the_batch_with_informative_groups(tmp_path):
    metrics, prompts, trained = _step(tmp_path, [[True, False, False], [False, True, True], [True] * 3], cap=4)
    assert metrics["samples/gen_batches"] == 2.0  # batch 0 kept 1 group, batch 1 filled the other 2: no third
    assert len(prompts) == 2 and prompts[0] != prompts[1]  # the second batch drew other prompts
    assert metrics["samples/kept_frac"] == 12 / 24 and "loss" in metrics
    groups = [g for g, _ in trained[0]]
    assert groups == [0] * GROUP + [1] * GROUP + [2] * GROUP  # renumbered, contiguous
    expected = [prompts[0][0], prompts[1][1], prompts[1][2]]
    assert [ids for _, ids in trained[0][::GROUP]] == expected


def test_resampling_stops_at_the_cap_and_trains_what_it_has(tmp_path):
    metrics, prompts, trained = _step(tmp_path, [[False, True, False], [False, False, True], [True] * 3], cap=2)
    assert metrics["samples/gen_batches"] == 2.0 and len(prompts) == 2
    assert [ids for _, ids in trained[0][::GROUP]] == [prompts[0][1], prompts[1][2]]
    assert metrics["samples/kept_frac"] == 8 / 24


def test_max_gen_batches_is_checked():
    with pytest.raises(SettingsError, match=r"rl.max_gen_batches=0 is not allowed; allowed values: integers >= 1"):
        resolve(load_config([*FAST, "rl.max_gen_batches=0"]))
