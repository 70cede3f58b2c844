"""A step's rollout batch, with DAPO's dynamic sampling and its re-sampling.

Dynamic sampling (``rl.dynamic_sampling``) drops the groups whose samples all got the same reward: their
advantages are 0 and they only dilute the batch. Re-sampling (``rl.max_gen_batches``, verl's
``algorithm.filter_groups.max_num_gen_batches``): while a rank holds fewer informative groups than the step's
prompts, the step generates another batch of prompts (``Task.resample_prompts``: a function of the step and the
batch's index, so a resumed run draws the same ones), until every rank's batch is full or ``rl.max_gen_batches``
batches were generated; a full batch keeps its first groups in generation order. Every rank generates the same
number of batches (a MAX over ranks: the decoder's collectives, expert all-to-all in lockstep or another rollout
layout, need every rank), a rank already full dropping its extra groups. A step that keeps nothing on any rank trains
nothing and says so in one line (``losses.untrained_step_line``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_iso.errors import NonFiniteError
from megatron_iso.rl.losses import informative_groups


@dataclass
class StepBatch:
    """``samples``: every sample generated (all batches; rewards set), ``kept``: the groups the step trains on,
    renumbered ``0 ..`` in order, ``gen_batches``: batches generated, ``gen_s``: seconds spent generating."""

    samples: list[Any]
    kept: list[Any]
    gen_batches: int
    gen_s: float


def check_finite_rollout(step: int, samples: list[Any], policy: str) -> None:
    """``rl.nonfinite=stop``: a NaN or Inf among the rollout's logprobs ends the run before the trainer sees it."""
    bad = sum(not all(math.isfinite(x) for x in s.rollout_logp) for s in samples)
    if bad and policy == "stop":
        raise NonFiniteError(
            f"step {step}: the rollout recorded NaN or Inf logprobs for {bad} of {len(samples)} samples "
            "(non-finite logits: the weights diverged; lower rl.lr, or rl.nonfinite=skip to drop such updates)"
        )


def _any_rank(flag: bool, device: torch.device) -> bool:
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
    return flag


def collect_step_batch(trainer: Any, step: int) -> StepBatch:
    """Generate, score and filter step ``step``'s groups (module docstring); ``trainer``: the loop's Trainer."""
    rl, size = trainer.rl, trainer.rl.group_size
    samples: list[Any] = []
    kept: list[Any] = []
    target, draws, gen_s = None, 0, 0.0
    while True:
        t0 = time.perf_counter()
        batch = trainer.rollout(step, draw=draws)
        gen_s += time.perf_counter() - t0
        draws += 1
        check_finite_rollout(step, batch, rl.nonfinite)
        rewards = trainer.score_rewards(batch)
        groups = len(batch) // size
        target = groups if target is None else target
        keep = informative_groups(rewards, size) if rl.dynamic_sampling else torch.ones(groups, dtype=torch.bool)
        for g in (int(i) for i in keep.nonzero()[:, 0]):
            if len(kept) // size < target:
                kept += [_regrouped(s, len(kept) // size) for s in batch[g * size : (g + 1) * size]]
        samples += batch
        if not rl.dynamic_sampling or draws >= rl.max_gen_batches:
            break
        if not _any_rank(len(kept) // size < target, trainer.device):
            break
    return StepBatch(samples, kept, draws, gen_s)


def _regrouped(sample: Any, group: int) -> Any:
    """``sample`` as a member of the kept batch's group ``group`` (groups are contiguous there, in order)."""
    import dataclasses

    return dataclasses.replace(sample, group=group)
