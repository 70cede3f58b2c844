"""Megatron's MoE aux-loss tracker is process-wide and sized by the first model's depth: a deeper MoE trainer
built later in the same process (a second benchmark profile, another model) must still train, and a step leaves
the tracker zeroed rather than summing over the run."""

from __future__ import annotations

import torch

from megatron_iso.parallel.world import seed_ranks
from megatron_iso.rl.trainer import Trainer
from megatron_iso.settings import config_world, resolve
from megatron_iso.settings.compose import load_config

FAST = ["model=tiny_moe", "rl.group_size=2", "rl.max_response_length=2", "task.prompts_per_step=2", "logger=none"]


def test_a_deeper_moe_trainer_after_a_shallower_one_trains(tmp_path):
    from megatron.core.transformer.moe import moe_utils

    sizes = []
    for layers in (2, 4):
        cfg = load_config([*FAST, f"model.num_layers={layers}", f"out_dir={tmp_path / str(layers)}"])
        with config_world(cfg) as rank:
            seed_ranks(int(cfg.seed))
            trainer = Trainer(resolve(cfg), rank)
            metrics = trainer.step(0)
            assert torch.isfinite(torch.tensor(metrics["loss"])), layers
            tracker = moe_utils.get_moe_layer_wise_logging_tracker()
            assert tracker, "the load-balancing loss was tracked"
            for entry in tracker.values():
                sizes.append(entry["values"].numel())
                assert not entry["values"].any(), "zeroed after the step"
    assert sizes[-1] == 4  # the second trainer's tracker has its own depth
