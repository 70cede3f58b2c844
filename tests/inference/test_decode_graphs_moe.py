"""Decode steps of an MoE model (tiny_moe) from static bucket buffers, run eagerly on CPU, give the
eager engine's tokens and logprobs bit for bit, the MoE layers taking their static-shape forward.

The bucket's batch carries ``IsoBatch.static_shapes`` (DecodeGraphs sets it on every bucket
batch), so the MoE layers dispatch without host reads and run the static grouped GEMM (counted
below); padding rows (buckets 2/5/6 over 1..6 running sequences) are routed and computed too and
must change no real row. The paged attention is the kernel-contract stand-in of
tests/inference/test_decode_graphs.py. The captured graph on a GPU:
tests/gpu/test_moe_static_graph.py."""

from __future__ import annotations

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases


def _run(static: bool, buckets: list[int] | None) -> dict:
    """:func:`engine_cases.staggered_run` of tiny_moe, counting the static grouped GEMMs it runs."""
    from megatron_iso.ops.gemm import grouped

    _, model = engine_cases.setup(["profile=correctness", "model=tiny_moe"])
    saved = grouped.grouped_reference_static
    static_gemms = []

    def counted(*args, **kwargs):
        static_gemms.append(1)
        return saved(*args, **kwargs)

    grouped.grouped_reference_static = counted
    try:
        run = engine_cases.staggered_run(model, static=static, buckets=buckets)
    finally:
        grouped.grouped_reference_static = saved
    return {
        "summary": run.summary,
        "steps": run.engine.stats.steps,
        "static_steps": run.static_steps,
        "static_gemms": len(static_gemms),
    }


def _all() -> dict:
    return {"eager": _run(False, None), "static": _run(True, None), "padded": _run(True, [2, 5, 6])}


def test_moe_static_decode_steps_give_the_eager_bits() -> None:
    runs = run_on_ranks(_all, 1)[0]
    eager = runs["eager"]["summary"]
    assert len(eager) >= 8 and runs["eager"]["static_gemms"] == 0
    for name in ("static", "padded"):
        engine_cases.assert_same_outputs(eager, runs[name]["summary"], f"{name} vs eager")
        static_steps = runs[name]["static_steps"]
        assert static_steps >= runs[name]["steps"] - 8 > 0, (static_steps, runs[name]["steps"])
        # 2 MoE layers x 2 grouped GEMMs per bucket step, all static
        assert runs[name]["static_gemms"] == 4 * static_steps, (runs[name]["static_gemms"], static_steps)
