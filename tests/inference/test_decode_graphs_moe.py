"""Decode steps of an MoE model (tiny_moe) from static bucket buffers, run eagerly on CPU, give the
eager engine's tokens and logprobs bit for bit, the MoE layers taking their static-shape forward.

The bucket's batch carries ``IsoBatch.static_shapes`` (set here on every bucket batch the graphs run,
as DecodeGraphs' buckets do for a capturable MoE model), so the MoE layers dispatch without host
reads and run the static grouped GEMM; padding rows (buckets 2/5/6 over 1..6 running sequences) are
routed and computed too and must change no real row. The paged attention is the kernel-contract
stand-in of tests/inference/test_decode_graphs.py. The captured graph on a GPU:
tests/gpu/test_moe_static_graph.py."""

from __future__ import annotations

import torch

from megatron_iso.testing.harness import run_on_ranks


def _run(static: bool, buckets: list[int] | None) -> dict:
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from megatron_iso.ops.gemm import grouped
    from tests.inference import engine_cases

    tc, model = engine_cases.setup(["profile=correctness", "model=tiny_moe"])
    saved = grouped.grouped_reference_static
    static_gemms = []

    def counted(*args, **kwargs):
        static_gemms.append(1)
        return saved(*args, **kwargs)

    grouped.grouped_reference_static = counted
    try:
        with engine_cases.paged_reads_as_on_cuda():
            specs = engine_cases.staggered_specs()
            reqs = engine_cases.requests(tc.vocab_size, specs)
            eng = RolloutEngine(model, EngineConfig(max_num_seqs=6, kv_cache_bytes=1 << 20, block_size=4))
            if static:
                graphs = eng.enable_decode_graphs(capture=False)
                if buckets is not None:
                    graphs.buckets = buckets
            outs = engine_cases.run_schedule(eng, reqs, [0, 0, 1, 3, 4, 4, 6, 9])
    finally:
        grouped.grouped_reference_static = saved
    return {
        "summary": engine_cases.summary(outs),
        "steps": eng.stats.steps,
        "static_steps": 0 if eng.decode_graphs is None else eng.decode_graphs.steps,
        "static_gemms": len(static_gemms),
    }


def _all() -> dict:
    return {"eager": _run(False, None), "static": _run(True, None), "padded": _run(True, [2, 5, 6])}


def test_moe_static_decode_steps_give_the_eager_bits() -> None:
    runs = run_on_ranks(_all, 1)[0]
    eager = runs["eager"]["summary"]
    assert len(eager) >= 8 and runs["eager"]["static_gemms"] == 0
    for name in ("static", "padded"):
        got = runs[name]["summary"]
        assert got.keys() == eager.keys(), name
        for key, (tok, lp, reason) in eager.items():
            tok2, lp2, reason2 = got[key]
            assert tok == tok2 and reason == reason2, (name, key)
            assert torch.equal(lp.view(torch.int32), lp2.view(torch.int32)), (name, key)
        static_steps = runs[name]["static_steps"]
        assert static_steps >= runs[name]["steps"] - 8 > 0, (static_steps, runs[name]["steps"])
        # 2 MoE layers x 2 grouped GEMMs per bucket step, all static
        assert runs[name]["static_gemms"] == 4 * static_steps, (runs[name]["static_gemms"], static_steps)
