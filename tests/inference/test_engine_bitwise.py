"""Iso profile: every rollout logprob the engine records equals the trainer's teacher-forced
recompute of the finished sequence, bit for bit: batch sizes 1/3/8, prefix caching on and off,
staggered arrivals (continuous batching), TP 1 and 2, rollout and trainer at different TP, and
over the full vocabulary. Sampled tokens do not depend on batch, arrival order or schedule."""

from __future__ import annotations

import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases


def _check_run(name: str, run) -> None:
    outs, trainer = run
    assert outs.keys() == trainer.keys()
    for key, (tokens, logp, reason) in outs.items():
        assert reason in ("stop", "length"), (name, key, reason)
        assert len(tokens) == logp.numel() == trainer[key].numel() > 0
        gap = float((logp - trainer[key]).abs().max())
        assert torch.equal(bits(logp), bits(trainer[key])), f"{name} {key}: max |dlogp| {gap:.3e}"


def _same_outputs(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][0] == b[k][0] and torch.equal(bits(a[k][1]), bits(b[k][1])) for k in a)


def test_rollout_logprobs_equal_trainer_tp1_and_tp2():
    tp1 = run_on_ranks(engine_cases.matrix, 1, args=([],))[0]
    tp2 = run_on_ranks(engine_cases.matrix, 2, tp=2, args=(["parallel.tp=2"], (8,)))
    reference = tp1["bs8_prefixTrue"][0]
    n_tokens = sum(len(v[0]) for v in reference.values())
    assert n_tokens > 40 and len(reference) == 12  # 8 requests, 12 samples
    for tp, runs in (("tp1", tp1), ("tp2.rank0", tp2[0]), ("tp2.rank1", tp2[1])):
        for name, run in runs.items():
            _check_run(f"{tp}.{name}", run)
            # Batch size, prefix caching, arrival order, step schedule and TP change nothing.
            assert _same_outputs(run[0], reference), f"{tp}.{name} differs from tp1 bs8 prefix on"
            # Rollout at TP=2 against a trainer at TP=1 (and vice versa): the same bits.
            for key in run[0]:
                assert torch.equal(bits(run[1][key]), bits(tp1["bs1_prefixFalse"][1][key]))
    distinct = {tuple(v[0]) for v in reference.values()}
    assert len(distinct) == len(reference)  # samples of a group differ (sample index keys the draws)


def test_full_vocab_logprobs_equal_trainer():
    engine_rows, trainer_rows = run_on_ranks(engine_cases.full_vocab, 1, args=([],))[0]
    assert engine_rows.shape == trainer_rows.shape and engine_rows.shape[0] >= 9
    assert torch.equal(bits(engine_rows), bits(trainer_rows))
