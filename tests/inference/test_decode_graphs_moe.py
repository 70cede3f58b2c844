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


def _native(path: str) -> dict:
    """Performance profile, tiny_moe in fp32: the staggered run with its MoE layers on Megatron's dispatcher
    (``megatron``: the engine as it was), on the static dispatch (``static``), or on the static dispatch from
    decode bucket buffers, 2/5/6 rows, run eagerly (``buckets``); the static dispatch's calls counted."""
    from megatron_iso.models import moe_serving

    _, model = engine_cases.setup(["profile=performance", "model=tiny_moe"])
    layers = [m for m in model.modules() if isinstance(m, moe_serving.NativeMoELayer)]
    if path == "megatron":
        for layer in layers:
            layer.static_unsupported = "test: Megatron's dispatcher"
    served = []
    real = moe_serving.NativeMoELayer.serve

    def counted(self, hidden):
        served.append(hidden.shape[0])
        return real(self, hidden)

    moe_serving.NativeMoELayer.serve = counted
    try:
        run = engine_cases.staggered_run(
            model, static=path == "buckets", buckets=[2, 5, 6] if path == "buckets" else None, paged=False
        )
    finally:
        moe_serving.NativeMoELayer.serve = real
    return {
        "summary": run.summary,
        "steps": run.engine.stats.steps,
        "static_steps": run.static_steps,
        "served": len(served),
        "graphs_off": run.graphs_off,
        "stacks": [s.fc1 is not None for s in moe_serving.expert_stacks(model)],
    }


def _native_all() -> dict:
    return {path: _native(path) for path in ("megatron", "static", "buckets")}


def test_native_moe_static_dispatch_keeps_megatrons_tokens() -> None:
    """The performance profile's engine on the static MoE dispatch (eager steps and decode bucket buffers) samples
    the tokens it sampled on Megatron's dispatcher, logprobs within fp32 rounding; the dispatch serves every MoE
    layer of every step, and nothing keeps native MoE decode out of CUDA graphs but the CPU."""
    runs = run_on_ranks(_native_all, 1)[0]
    ref = runs["megatron"]
    assert ref["served"] == 0 and len(ref["summary"]) >= 8
    assert ref["graphs_off"].startswith("CUDA graphs need a CUDA device"), ref["graphs_off"]
    for name in ("static", "buckets"):
        run = runs[name]
        assert run["served"] == 2 * run["steps"], (name, run["served"], run["steps"])  # 2 MoE layers per step
        assert run["stacks"] == [True, True], name
        assert run["summary"].keys() == ref["summary"].keys(), name
        worst = 0.0
        for key, (tok, lp, reason) in ref["summary"].items():
            tok2, lp2, reason2 = run["summary"][key]
            assert tok == tok2 and reason == reason2, (name, key)
            worst = max(worst, float((lp - lp2).abs().max()))
        assert worst < 1e-5, (name, worst)  # a wrong expert or weight moves logprobs by O(0.1), fp32 rounding ~1e-7
    assert runs["buckets"]["static_steps"] >= runs["buckets"]["steps"] - 8 > 0
