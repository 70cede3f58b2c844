"""Iso profile: rollout logprobs == trainer logprobs bit for bit for tiny_hybrid_moe (GDN + MoE MLP)
and tiny_moe in the engine, and for tiny_hybrid at TP 2 (gloo, the ranks in lockstep), where the
samples are also the TP 1 samples and the TP 2 rollout equals a TP 1 trainer."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import hybrid_cases
from tests.inference.test_engine_bitwise import _same_outputs
from tests.inference.test_engine_hybrid import CHUNKED, check_runs


@pytest.mark.parametrize(
    ("overrides", "batch_sizes"),
    [(["model=tiny_hybrid_moe", *CHUNKED], (3,)), (["model=tiny_moe"], (1, 3))],
    ids=["tiny_hybrid_moe", "tiny_moe"],
)
def test_moe_models_rollout_logprobs_equal_trainer(overrides, batch_sizes):
    runs = run_on_ranks(hybrid_cases.schedules, 1, args=(overrides, batch_sizes))[0]
    assert "staggered" in runs and "bs3_prefixFalse" in runs
    check_runs(overrides[0], runs)


def test_hybrid_tp2_rollout_equals_tp1_and_trainer():
    over = ["model=tiny_hybrid", *CHUNKED]
    tp1 = run_on_ranks(hybrid_cases.schedules, 1, args=(over, (8,), False))[0]["bs8_prefixTrue"]
    tp2 = run_on_ranks(hybrid_cases.schedules, 2, tp=2, args=([*over, "parallel.tp=2"], (8,)))
    for rank, runs in enumerate(tp2):
        check_runs(f"tiny_hybrid.tp2.rank{rank}", runs)
        for name, (outs, _) in runs.items():
            assert _same_outputs(outs, tp1[0]), f"rank {rank} {name}: TP 2 samples differ from TP 1"
            for key in outs:  # rollout at TP 2 against the trainer at TP 1
                assert torch.equal(outs[key][1].view(torch.int32), tp1[1][key].view(torch.int32))
