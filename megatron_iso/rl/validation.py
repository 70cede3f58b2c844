"""The validation pass: the policy's responses to ``data.val_files``, scored by the task's reward.

It runs every ``rl.val_every`` steps (0 = never) on the policy that step's rollout samples from (the weights after
``step`` updates), at step 0 too unless ``rl.val_before_train=false`` (verl's ``val_before_train``), and once more
after the last step on the final policy (logged as step ``rl.steps``). Its metrics join that step's line:

- ``val/reward_mean``: the task reward averaged over every validation sample;
- ``val/pass@1``: the chance that one sample passes (reward >= 1, the full reward), averaged over prompts: with
  ``rl.val_n`` > 1 the share of a prompt's samples that pass; ``val/pass@<n>``: the share of prompts with at
  least one passing sample among their n;
- ``val/response_length_mean``, ``val/truncated_frac`` (samples that hit ``rl.max_response_length``),
  ``val/prompts``, ``timing/val_s``.

Greedy by default (``rl.val_temperature=0``: argmax, ties to the lowest token id); sampled runs draw from request
ids ``val:<step>:<row>``, so a validation is the same on a resumed run and across layouts.
"""

from __future__ import annotations

import time
from typing import Any

from megatron_iso.inference.params import Request
from megatron_iso.rl.sampling import generate_shares, val_params
from megatron_iso.settings import RLSettings

PASS_REWARD = 1.0  # a sample passes when its reward reaches this (math-verify's 1 for a right answer)


def due(rl: RLSettings, step: int, last: bool = False) -> bool:
    """Whether a validation runs at ``step`` (``last``: after the final step)."""
    if not rl.val_every:
        return False
    if step == 0:
        return rl.val_before_train
    return last or step % rl.val_every == 0


def validate(trainer: Any, step: int) -> dict[str, float]:
    """One validation pass of ``trainer`` (a :class:`~megatron_iso.rl.trainer.Trainer`) at ``step``: every DP rank
    generates its share of the rows, the scores are gathered, every rank returns the same metrics."""
    t0 = time.perf_counter()
    rl: RLSettings = trainer.rl
    task = trainer.tasks.val
    prompts = task.all_prompts()
    params = val_params(rl, trainer.tasks.stop_ids, trainer.settings.require("seed"))
    dp = trainer.dp_size

    def requests_of(d: int) -> list[Request]:
        return [Request(f"val:{step}:{d + i * dp}", p.ids, params) for i, p in enumerate(prompts[d::dp])]

    outs = generate_shares(trainer, requests_of)
    rows = []
    for prompt, out in zip(prompts[trainer.dp_rank :: dp], outs, strict=True):
        rows.append(
            (
                [task.reward(prompt, list(s.tokens)) for s in out.samples],
                [len(s.tokens) for s in out.samples],
                [s.finish_reason == "length" for s in out.samples],
            )
        )
    everyone = [row for part in trainer._gather(rows) for row in part]
    return {**val_metrics(everyone, rl.val_n), "timing/val_s": time.perf_counter() - t0}


def val_metrics(rows: list[tuple[list[float], list[int], list[bool]]], n: int) -> dict[str, float]:
    """The ``val/*`` metrics of per-prompt (rewards, lengths, truncated) of its ``n`` samples."""
    rewards = [r for row in rows for r in row[0]]
    lengths = [x for row in rows for x in row[1]]
    passed = [[r >= PASS_REWARD for r in row[0]] for row in rows]
    out = {
        "val/reward_mean": sum(rewards) / len(rewards),
        "val/pass@1": sum(sum(p) / len(p) for p in passed) / len(passed),
        "val/response_length_mean": sum(lengths) / len(lengths),
        "val/truncated_frac": sum(t for row in rows for t in row[2]) / len(lengths),
        "val/prompts": float(len(rows)),
    }
    if n > 1:
        out[f"val/pass@{n}"] = sum(any(p) for p in passed) / len(passed)
    return out
