"""The RL loop at context parallelism 2 (``parallel.cp=2``, micro-batches of 3 samples): the rollout engine runs
CP 1 (colocated, on each CP rank), the trainer CP 2; its recomputed logprobs equal the rollout's bit for bit
(mismatch 0) and the first step's rollout, logprobs and loss equal a CP 1 run's. A CP 2 run checkpoint resumes at
CP 1 (weights are not sharded by CP) and repeats the uninterrupted run's next step: the same rollout and loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_iso.rl.run import TIMING_PREFIXES
from megatron_iso.testing.harness import run_on_ranks
from tests.rl.test_reshard_checkpoint import _rewound_copy

pytestmark = pytest.mark.slow

RUN = [
    "rl.group_size=4",
    "rl.max_response_length=3",
    "task.prompts_per_step=2",
    "task.prompt_len=5",
    "logger=none",
    "rl.train_micro_batch_seqs=3",
    "rl.steps=3",
    "rl.checkpoint_every=2",
]


def _train(out: str, overrides: list[str]) -> list[dict]:
    from megatron_iso.parallel.world import seed_ranks
    from megatron_iso.rl.run import train
    from megatron_iso.settings.compose import load_config

    cfg = load_config([*RUN, f"out_dir={out}", *overrides])
    seed_ranks(int(cfg.seed))
    return train(cfg)["history"]


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES) and "memory" not in k} for r in rows]


def _without(row: dict, *keys: str) -> dict:
    return {k: v for k, v in row.items() if k not in keys}


def test_rl_at_cp2_matches_cp1_and_its_checkpoint_resumes_at_cp1(tmp_path):
    run_on_ranks(_train, 2, cp=2, args=(str(tmp_path / "cp2"), ["parallel.cp=2"]))
    cp2 = _rows(tmp_path / "cp2")
    assert [r["step"] for r in cp2] == [0, 1, 2]
    for r in cp2:  # the trainer's CP 2 recompute is the rollout's bits at every step
        assert r["mismatch/abs_diff_max"] == 0.0 and r["mismatch/bitwise_equal_frac"] == 1.0, r
    # Resume CP 2's step-1 checkpoint at CP 1 on one rank: step 2 again, as the uninterrupted CP 2 run had it.
    resumed_run = tmp_path / "resumed"
    _rewound_copy(tmp_path / "cp2", resumed_run, 1)
    run_on_ranks(_train, 1, args=(str(resumed_run), ["resume=true"]))
    again = _rows(resumed_run)
    assert [r["step"] for r in again] == [0, 1, 2]
    # Everything but the grad norm (the backward sums dK/dV over CP ranks: not bitwise CP-invariant).
    assert _without(again[2], "grad_norm") == _without(cp2[2], "grad_norm")
    assert abs(again[2]["grad_norm"] - cp2[2]["grad_norm"]) <= 1e-4 * cp2[2]["grad_norm"]
    # The first step at CP 1 (one rank): the same rollout, logprobs and loss as CP 2's.
    run_on_ranks(_train, 1, args=(str(tmp_path / "cp1"), ["rl.steps=1"]))
    first = _rows(tmp_path / "cp1")[0]
    assert _without(first, "grad_norm", "optim/lr") == _without(cp2[0], "grad_norm", "optim/lr")
