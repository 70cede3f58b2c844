"""tools/bench_ops.py --moe on CPU: the routed token counts it times (``megatron_iso.bench.kernels.moe``) are
seeded, skewed and complete, and the tool says it needs a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from megatron_iso.bench.kernels import moe

_spec = importlib.util.spec_from_file_location("bench_ops", Path(__file__).parents[2] / "tools" / "bench_ops.py")
bench_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_ops)


def test_moe_counts_are_seeded_skewed_and_sum_to_tokens_times_topk():
    for tokens in (64, 4096):
        counts = moe.moe_counts(tokens)
        assert counts == moe.moe_counts(tokens)  # fixed seed
        assert len(counts) == moe.MOE_E and sum(counts) == tokens * moe.MOE_TOPK
        assert max(counts) > 3 * sum(counts) / len(counts)  # skewed: hot experts
    assert 0 in moe.moe_counts(64)  # small T leaves experts empty
    assert moe.moe_counts(64, seed=1) != moe.moe_counts(64)
    # k distinct experts per token: no expert gets more rows than there are tokens
    assert max(moe.moe_counts(16, topk=8)) <= 16
    assert torch.cuda.is_available() or bench_ops.main(["--moe"]) == 2  # needs a GPU, says so
