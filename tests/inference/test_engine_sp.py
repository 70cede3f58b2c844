"""The rollout engine at TP 2 with sequence parallelism (``parallel.sp=true``) on gloo ranks: any token count.

SP splits a forward's rows evenly over the TP ranks, so the engine pads a step whose token count does not divide by
TP with one-token sequences in the KV cache's scratch block (and the GDN scratch slot), and its decode graph buckets
are multiples of TP (``inference.engine``, ``inference.cuda_graphs``). The schedule has odd prompt lengths (1, 3, 5,
7, 9, 17), staggered arrivals and groups of 1, 2 and 3 samples, so eager prefill and decode steps and bucket steps
see odd token counts (counted below, so the test fails if they stop doing so). The claims, for a dense model, a GDN
hybrid and an MoE model (EP 1), on every rank: the tokens and logprobs of the eager steps (paged KV reads through
the kernel's contract stand-in of tests/inference/test_decode_graphs.py, and the CPU's staged views) and of the
bucket steps (``enable_decode_graphs(capture=False)``) are TP 2 without SP's and TP 1's bit for bit, and the
trainer's recompute at TP 2 with SP (its own padding, ``pack(pad_to_multiple=2)``) gives them bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases

MODELS = {
    "tiny_dense": ["profile=correctness"],
    "tiny_hybrid": ["profile=correctness", "model=tiny_hybrid", "profile.gdn_chunk=4"],
    "tiny_moe": ["profile=correctness", "model=tiny_moe"],
}
SP = ["parallel.tp=2", "parallel.sp=true"]


def _generate(model, tc, buckets: list[int] | None, *, static: bool, paged: bool = True) -> tuple[dict, dict, dict]:
    """:func:`engine_cases.staggered_run` of the model: the outputs' summary, the token counts of its eager forwards
    and the row counts of its bucket steps, and the trainer's scores. ``paged``: attention reads the pool in place
    (the kernel's stand-in, as on CUDA), else the CPU's staged views."""
    from megatron_iso.models.batch import row_multiple

    counts: dict = {"eager": [], "bucket": []}

    def watch(eng) -> None:
        forward = eng._forward
        eng._forward = lambda seqs, case, starts, chunks, n, ids: (
            counts["eager"].append(sum(n)) or forward(seqs, case, starts, chunks, n, ids)
        )
        if static:
            graphs = eng.decode_graphs
            step = graphs.decode_step
            graphs.decode_step = lambda starts, *a: counts["bucket"].append(len(starts)) or step(starts, *a)

    run = engine_cases.staggered_run(model, static=static, buckets=buckets, paged=paged, watch=watch)
    trainer = engine_cases.trainer_scores(model, run.requests, run.outputs, pad_to_multiple=row_multiple(tc))
    return run.summary, counts, trainer


def _tp1(names: list[str]) -> dict:

    out = {}
    for name in names:
        tc, model = engine_cases.setup(MODELS[name])
        out[name] = _generate(model, tc, None, static=False)[0]
    return out


def _tp2(name: str) -> dict:
    """TP 2 without SP (eager), and with SP: eager (paged and staged KV reads), default buckets (2, 4, 6) and
    buckets 4, 6 (more padding)."""

    tc, model = engine_cases.setup([*MODELS[name], "parallel.tp=2"])
    runs = {"no_sp": _generate(model, tc, None, static=False)}
    tc, model = engine_cases.setup([*MODELS[name], *SP])
    assert tc.sequence_parallel
    runs["sp_eager"] = _generate(model, tc, None, static=False)
    runs["sp_staged"] = _generate(model, tc, None, static=False, paged=False)
    runs["sp_static"] = _generate(model, tc, None, static=True)
    runs["sp_padded"] = _generate(model, tc, [4, 6], static=True)
    return runs


@pytest.fixture(scope="module")
def tp1() -> dict:
    return run_on_ranks(_tp1, 1, args=(list(MODELS),))[0]


@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_sp_engine_gives_the_tp1_and_no_sp_bits(tp1: dict, model: str) -> None:
    ref = tp1[model]
    assert len(ref) >= 8
    for rank, runs in enumerate(run_on_ranks(_tp2, 2, tp=2, args=(model,))):
        engine_cases.assert_same_outputs(ref, runs["no_sp"][0], f"{model} rank {rank}: TP 2 without SP vs TP 1")
        for name in ("sp_eager", "sp_staged", "sp_static", "sp_padded"):
            summary, counts, trainer = runs[name]
            engine_cases.assert_same_outputs(ref, summary, f"{model} rank {rank}: {name} vs TP 1")
            for key, (_, lp, _) in summary.items():  # the rollout's logprobs are the trainer's recompute
                assert torch.equal(bits(lp), bits(trainer[key])), (model, rank, name, key)
            # Odd token counts did reach the forward: prefill steps always, decode steps in the eager run.
            assert any(c % 2 for c in counts["eager"]), (name, counts)
            if name in ("sp_eager", "sp_staged"):
                assert counts["bucket"] == [] and sum(c % 2 for c in counts["eager"]) >= 3, counts
            else:  # bucket steps of odd row counts, served from even buckets
                assert len(counts["bucket"]) >= 8 and any(c % 2 for c in counts["bucket"]), counts


def _bucket_sizes() -> dict:
    from megatron_iso.inference import EngineConfig, RolloutEngine

    _, model = engine_cases.setup(["profile=correctness", *SP])
    eng = RolloutEngine(model, EngineConfig(max_num_seqs=7, kv_cache_bytes=1 << 20, block_size=4))
    graphs = eng.enable_decode_graphs(capture=False)
    out = {"buckets": graphs.buckets, "scratch": (graphs.scratch, eng.kv.scratch_block())}
    try:
        graphs.buckets = [3, 8]
        graphs._bucket(graphs._key(3, 1))
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_sp_buckets_are_multiples_of_tp() -> None:
    from megatron_iso.inference.cuda_graphs import default_buckets

    assert default_buckets(7, 2) == [2, 4, 8]
    assert default_buckets(20, 4) == [4, 8, 16, 20]
    assert default_buckets(6) == [1, 2, 4, 6]
    got = run_on_ranks(_bucket_sizes, 2, tp=2)[0]
    assert got["buckets"] == [2, 4, 8]
    assert got["scratch"][0] == got["scratch"][1]  # eager padding and the buckets share one scratch block
    assert "multiples of 2" in got["refused"], got
