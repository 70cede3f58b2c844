"""PPO updates per rollout batch (``rl.ppo_mini_batch_size``, ``rl.ppo_epochs``) and the old policy's logprobs.

A step's kept samples are split into ``task.prompts_per_step / rl.ppo_mini_batch_size`` mini-batches of whole groups
(verl's unit: prompts, each with its ``rl.group_size`` samples; a data-parallel rank splits its own share into that
many, so every rank takes the same number of optimizer steps), one optimizer step each (:meth:`Trainer.train_on`,
in ``rl.train_micro_batch_seqs`` micro-batches), repeated ``rl.ppo_epochs`` times in the same order. The advantages
are the whole batch's; each mini-batch's loss is normalised over its own tokens (or sequences).

Every update after the first scores a policy that has moved, so the PPO ratio needs the old policy's logprobs,
``pi_old`` = the trainer's policy at the rollout's weights (:func:`old_logprob_source`):

- ``forward``: one update, reading its own forward's logprobs (detached): today's on-policy step, no extra cost;
- ``rollout``: the rollout's recorded logprobs. In the correctness profile they are the trainer's bit for bit
  (the contract), so no forward is spent on them: the speed gain only exactness gives;
- ``recompute``: one no-grad trainer forward over the batch before the first update (stock stacks' way; needed in
  the performance profile, where the rollout's logprobs are not the trainer's).

``rl.recompute_old_logprobs``: ``auto`` picks ``rollout`` in the correctness profile and ``recompute`` in the
performance profile whenever more than one update (or ``rl.rollout_correction.mode=mask``, whose normaliser needs
``pi_old`` before the update) reads them; ``true`` / ``false`` force ``recompute`` / ``rollout``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron_iso.errors import UserError
from megatron_iso.rl.correction import correction_weights
from megatron_iso.rl.losses import PolicyLossConfig, loss_normaliser
from megatron_iso.rl.pipeline import pack_micro_batch, score_micro_batch
from megatron_iso.settings.rl import ppo_mini_batches

OLD_SOURCES = ("forward", "rollout", "recompute")
# Per-update scalars the step reports as their mean over the updates; the rest are summed (counts, seconds).
_SUMMED = ("nonfinite/skipped", "timing/weight_sync_s", "timing/old_logp_s")
# What each pi_old source means, for the run's start line.
_SOURCE_WORDS = {
    "forward": "each update's own forward",
    "recompute": "one no-grad trainer forward before the first update (timing/old_logp_s)",
}


class PPOSetupError(UserError, ValueError):
    """A PPO schedule the run cannot take (the fields named)."""


def mini_batch_count(rl: Any, prompts_per_step: int) -> int:
    """Optimizer steps per epoch: ``prompts_per_step / rl.ppo_mini_batch_size`` (1 for 0 / null, the whole batch);
    checked with the config (``settings.check_config``)."""
    return ppo_mini_batches(rl, prompts_per_step)


def old_logprob_source(rl: Any, bitwise: bool, updates: int) -> str:
    """Where ``pi_old`` comes from (one of :data:`OLD_SOURCES`; module docstring). ``bitwise``: the correctness
    profile, whose rollout logprobs are the trainer's bit for bit."""
    if rl.recompute_old_logprobs == "true":
        return "recompute"
    if updates == 1 and not rl.rollout_correction.rejects:
        return "forward"
    if rl.recompute_old_logprobs == "false" or bitwise:
        return "rollout"
    return "recompute"


def check_schedule(trainer: Any) -> tuple[int, str]:
    """``(mini-batches per epoch, old logprob source)`` of the run, refused where the trainer cannot run it."""
    rl = trainer.rl
    count = mini_batch_count(rl, trainer.task.prompts_per_step)
    source = old_logprob_source(rl, trainer.settings.profile.bitwise, count * rl.ppo_epochs)
    if source == "recompute" and trainer.tc.pipeline_model_parallel_size > 1:
        raise PPOSetupError(
            "recomputing the old logprobs (rl.recompute_old_logprobs, or its auto in the performance profile with "
            "several updates) is not supported with parallel.pp > 1; use rl.recompute_old_logprobs=false or "
            "parallel.pp=1"
        )
    return count, source


def schedule_line(trainer: Any) -> str | None:
    """The run's start line on what a step's update does, where it is not one update reading its own forward
    without correction (the default, which needs no line)."""
    rl, (count, source) = trainer.rl, trainer.ppo_schedule
    correction, updates = rl.rollout_correction, count * rl.ppo_epochs
    if updates == 1 and source == "forward" and not correction.active:
        return None
    prompts = trainer.task.prompts_per_step
    words = _SOURCE_WORDS.get(source)
    if words is None:  # the rollout's
        exact = trainer.settings.profile.bitwise
        words = "the rollout's logprobs, no forward spent " + (
            "(bit for bit the trainer's in the correctness profile)"
            if exact
            else "(rl.recompute_old_logprobs=false: NOT the trainer's in this profile)"
        )
    line = (
        f"ppo: {_count(updates, 'optimizer step')} per RL step ({_count(count, 'mini-batch', 'es')} of "
        f"{_count(prompts // count, 'prompt')} x {_count(rl.ppo_epochs, 'epoch')}); pi_old: {words}"
    )
    if correction.active:
        lower, upper = correction.band
        bounds = f"upper {upper:g}" if correction.mode == "truncate" else f"band [{lower:g}, {upper:g}]"
        line += f"; rollout correction: {correction.mode} at {correction.level} level, {bounds}"
    return line


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}{plural if n != 1 else ''}"


def step_normaliser(cfg: PolicyLossConfig, samples: list[Any], seq_index: torch.Tensor) -> float:
    """The loss normaliser of an update over ``samples`` (``seq_index``: their response tokens' sample, in order):
    :func:`loss_normaliser` over all response tokens, less those ``rl.rollout_correction.mode=mask`` rejects
    (known before the update from the samples' ``old_logp``)."""
    every = torch.ones(seq_index.numel(), dtype=torch.bool)
    correction = cfg.correction
    if not correction.rejects or not samples:
        return loss_normaliser(every, seq_index, cfg.aggregation)
    if any(s.old_logp is None for s in samples):
        raise ValueError("rl.rollout_correction.mode=mask needs the old logprobs before the update (rl.ppo)")
    old = torch.cat([s.old_logp for s in samples])
    rollout = torch.tensor([x for s in samples for x in s.rollout_logp], dtype=torch.float32)
    kept = ~correction_weights(old, rollout, every, seq_index, correction)[1]
    return loss_normaliser(kept, seq_index, cfg.aggregation)


def split_groups(samples: list[Any], advantages: torch.Tensor, group_size: int, count: int) -> list[tuple]:
    """``count`` contiguous mini-batches of whole groups (sizes as equal as can be; some empty when this rank holds
    fewer groups than ``count``), each ``(samples, advantages)``."""
    groups = len(samples) // group_size
    base, extra = divmod(groups, count)
    out, start = [], 0
    for j in range(count):
        end = start + (base + (j < extra)) * group_size
        out.append((samples[start:end], advantages[start:end]))
        start = end
    return out


@torch.no_grad()
def recompute_old_logprobs(trainer: Any, samples: list[Any], filler: Any) -> torch.Tensor:
    """One no-grad trainer forward over ``samples`` (in ``rl.train_micro_batch_seqs`` micro-batches; as many passes
    as the rank with the most, ``filler`` for the rest, as the update does): sets each sample's ``old_logp`` and
    returns the response tokens' entropies (empty without ``rl.log_entropy``)."""
    bounds = trainer._micro_batch_bounds(len(samples))
    passes = trainer.micro_batch_count(len(samples))
    entropies = []
    for j in range(passes):
        part = samples[slice(*bounds[j])] if j < len(bounds) else [filler]
        mb = pack_micro_batch(trainer, part, torch.zeros(len(part)), 1.0)
        logp, ent = score_micro_batch(trainer.ddp.module, mb, trainer.rl.temperature, trainer.device,
                                      trainer.rl.log_entropy)  # fmt: skip
        if j >= len(bounds):
            continue  # the filler pass only keeps this rank in step with the others' collectives
        logp = logp.float().cpu()[mb["mask"]]
        if ent is not None:
            entropies.append(ent.float().cpu()[mb["mask"]])
        for s, old in zip(part, logp.split([len(s.tokens) for s in part]), strict=True):
            s.old_logp = old
    return torch.cat(entropies) if entropies else torch.zeros(0)


def run_updates(
    trainer: Any, samples: list[Any], advantages: torch.Tensor, *, passes: int, filler: Any
) -> list[dict[str, Any]]:
    """The step's optimizer updates on the kept ``samples`` (``passes``: :meth:`Trainer.micro_batch_count` of them,
    already agreed): their outputs in order, the first's ``trained_lengths`` / ``trainer_logp`` / ``rollout_logp`` /
    ``entropy`` those of the tokens scored at the rollout's weights (the step's mismatch metrics). One update
    reading its own forward is today's step exactly."""
    count, source = trainer.ppo_schedule
    lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.long)
    if count * trainer.rl.ppo_epochs == 1 and source == "forward":
        return [
            trainer.train_on(samples, advantages, micro_batches=passes, filler=filler) | {"trained_lengths": lengths}
        ]
    mismatch: dict[str, Any] = {}
    if source == "recompute":
        t0 = time.perf_counter()
        entropy = recompute_old_logprobs(trainer, samples, filler)
        old = torch.cat([s.old_logp for s in samples]) if samples else torch.zeros(0)
        rollout = torch.tensor([x for s in samples for x in s.rollout_logp], dtype=torch.float32)
        mismatch = {"trainer_logp": old, "rollout_logp": rollout, "entropy": entropy, "trained_lengths": lengths,
                    "timing/old_logp_s": time.perf_counter() - t0}  # fmt: skip
    else:  # the rollout's, bit for bit the trainer's in the correctness profile
        for s in samples:
            s.old_logp = torch.tensor(s.rollout_logp, dtype=torch.float32)
    chunks = split_groups(samples, advantages, trainer.rl.group_size, count)
    outs: list[dict[str, Any]] = []
    for _ in range(trainer.rl.ppo_epochs):
        for part, adv in chunks:
            n = trainer.micro_batch_count(len(part))  # a collective: the same on every rank
            if not n:
                continue
            out = trainer.train_on(part, adv, micro_batches=n, filler=filler, publish=False)
            if not outs and not mismatch:
                # The first update's forward scored its samples at the rollout's weights: the mismatch of those.
                out["trained_lengths"] = torch.tensor([len(s.tokens) for s in part], dtype=torch.long)
            outs.append(out)
    if outs:
        outs[0] |= mismatch
        t0 = time.perf_counter()
        trainer.publish_weights()  # once, after the last update: the next rollout's policy
        outs[-1]["timing/weight_sync_s"] = time.perf_counter() - t0
    return outs


def merge_updates(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's view of its updates: the first's tensors (the mismatch at the rollout's weights), the scalars'
    mean over the updates (counts and seconds summed), and ``ppo/updates``. One update: its output as it is."""
    if len(outs) == 1:
        return outs[0]
    merged = dict(outs[0])
    for key, value in outs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [float(o[key]) for o in outs if key in o]
            merged[key] = sum(values) if key in _SUMMED else sum(values) / len(values)
    merged["update_ok"] = all(bool(o["update_ok"]) for o in outs)
    merged["ppo/updates"] = float(len(outs))
    return merged
