"""The RL loop on the hybrid model (Gated DeltaNet layers): the engine carries GDN state between
decode steps and is flushed after every optimizer step, so the rollout logprobs equal the trainer's
on every token of every step."""

from __future__ import annotations

import json

from megatron_iso.rl.run import train
from megatron_iso.settings.compose import load_config

# GDN chunk 4: prompts and the 4 generated tokens cross chunk boundaries; step 1 runs on updated weights.
TINY = ["model=tiny_hybrid", "profile.gdn_chunk=4", "rl.group_size=2", "rl.max_response_length=4"]


def test_hybrid_grpo_run_has_zero_mismatch(tmp_path):
    cfg = load_config([*TINY, "task.prompts_per_step=2", "rl.steps=2", f"out_dir={tmp_path / 'hybrid'}"])
    out = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "hybrid" / "metrics.jsonl").read_text().splitlines()]
    assert out["steps_run"] == 2 and [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["mismatch/abs_diff_max"] == 0.0
        assert r["mismatch/bitwise_equal_frac"] == 1.0
