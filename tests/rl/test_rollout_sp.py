"""The RL loop at TP 2 with sequence parallelism and token counts that do not divide by TP: one prompt of 5 tokens
(an odd prefill) and groups of 3 samples (decode steps of 3 rows). The rollout engine pads such steps with rows of
their own (``inference.engine``), the trainer pads its packs with a filler sequence (``rl.pipeline``); the rollout
logprobs equal the trainer's recompute bit for bit (mismatch 0), and every logged number equals TP 2 without SP's.
"""

from __future__ import annotations

import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

ODD = [
    "rl.group_size=3",
    "rl.max_response_length=3",
    "task.prompts_per_step=1",
    "task.prompt_len=5",
    "logger=none",
    "rl.steps=2",
    "parallel.tp=2",
]


def _train(root: str) -> dict:
    from megatron_iso.rl import run, trainer
    from megatron_iso.rl.run import TIMING_PREFIXES
    from megatron_iso.settings.compose import load_config

    runs = {}
    train_on = trainer.Trainer.train_on
    for sp in ("false", "true"):
        steps = []

        def recorded(self, *args, _steps=steps, **kwargs):
            out = train_on(self, *args, **kwargs)
            _steps.append({k: out[k].clone() for k in ("trainer_logp", "rollout_logp")})
            return out

        trainer.Trainer.train_on = recorded
        try:
            history = run.train(load_config([*ODD, f"parallel.sp={sp}", f"out_dir={root}/sp_{sp}"]))["history"]
        finally:
            trainer.Trainer.train_on = train_on
        rows = [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in history]
        runs[sp] = (steps, rows)
    return runs


def test_rollout_at_tp2_sp_with_odd_token_counts_equals_the_trainer(tmp_path):
    for rank, runs in enumerate(run_on_ranks(_train, 2, tp=2, args=(str(tmp_path),), timeout=600)):
        steps, rows = runs["true"]
        assert len(steps) == len(rows) == 2
        for step, got in enumerate(steps):
            assert got["rollout_logp"].numel() >= 3, (rank, step)
            assert torch.equal(bits(got["rollout_logp"]), bits(got["trainer_logp"])), (rank, step)
        for r in rows:
            assert r["mismatch/abs_diff_max"] == 0.0 and r["mismatch/bitwise_equal_frac"] == 1.0, (rank, r)
        # SP is a memory layout: TP 2 without it logs the same numbers and logprobs.
        assert rows == runs["false"][1], rank
        for a, b in zip(steps, runs["false"][0], strict=True):
            assert torch.equal(bits(a["rollout_logp"]), bits(b["rollout_logp"])), rank
