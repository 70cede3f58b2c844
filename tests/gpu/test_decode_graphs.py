"""Captured decode graphs on a CUDA device: the engine replaying CUDA graphs gives the eager engine's
tokens and logprobs bit for bit (mixed prompt lengths, sequences leaving at different steps, staggered
arrivals, several buckets, a weight update in place between generations), for a dense model and for a
hybrid one with Gated DeltaNet layers. The CPU half of the claim (bucket buffers, padding, device-read
positions, GDN slots) is tests/inference/test_decode_graphs.py and test_gdn_decode_graphs.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

ARRIVALS = [0, 0, 1, 3, 4, 4, 6, 9, 2, 5, 7]  # the step before which each request joins


def _generate(model, reqs, graphs: bool):
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from tests.inference import engine_cases

    cfg = EngineConfig(max_num_seqs=6, kv_cache_bytes=96 << 20, block_size=16, cuda_graphs=graphs)
    eng = RolloutEngine(model, cfg)
    outs = engine_cases.run_schedule(eng, reqs, ARRIVALS)
    return eng, engine_cases.summary(outs)


def _eager_and_captured(profile: str, dtype: str):
    """Qwen3-0.6B shapes (the Triton GEMM's tiles need real widths), two layers: the same requests
    through an eager engine and a graph-replaying one (mixed lengths, sequences leaving at different
    steps, staggered arrivals)."""
    from tests.inference import engine_cases

    shape = ["model=qwen3_0p6b", "model.num_layers=2", f"model.params_dtype={dtype}"]
    tc, model = engine_cases.setup([f"profile={profile}", *shape])
    specs = [(rid, n, {**kw, "max_new_tokens": 5 + 3 * (i % 4)}) for i, (rid, n, kw) in enumerate(engine_cases.SPECS)]
    # and long ones: decode crosses 64-key tiles, blocks of 16 and (native) the 256 -> 512 staging length
    specs += [
        (201, 150, {"max_new_tokens": 40}),
        (202, 240, {"max_new_tokens": 40}),
        (203, 300, {"max_new_tokens": 24}),
    ]
    reqs = engine_cases.requests(tc.vocab_size, specs)
    _, eager = _generate(model, reqs, graphs=False)
    eng, captured = _generate(model, reqs, graphs=True)
    graphs = eng.decode_graphs
    assert graphs is not None, eng.decode_graphs_off
    assert graphs.disabled is None, graphs.disabled
    assert graphs.captures >= 2 and graphs.replays > 0, (graphs.captures, graphs.replays)
    return tc, model, reqs, eng, eager, captured


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_captured_decode_gives_the_eager_bits(dtype: str) -> None:
    from megatron_iso.models.weights import load_hf_state_dict, random_hf_state_dict
    from megatron_iso.parallel.world import launched_world
    from tests.inference import engine_cases

    with launched_world(seed=7):
        tc, model, reqs, eng, eager, captured = _eager_and_captured("correctness", dtype)
        assert eng.decode_graphs.paged
        engine_cases.assert_same_outputs(eager, captured, "eager vs captured")

        # New weights copied in place (the colocated trainer's case): the graphs stay valid.
        load_hf_state_dict(model, random_hf_state_dict(tc, seed=11), tc)
        eng.on_weights_updated()
        assert not eng.decode_graphs.parameters_moved()
        again = engine_cases.summary(engine_cases.run_schedule(eng, reqs, ARRIVALS))
        _, fresh = _generate(model, reqs, graphs=False)
        engine_cases.assert_same_outputs(fresh, again, "after a weight update")


def test_native_captured_decode_stays_close_to_eager() -> None:
    """The performance profile (native baseline) captured: staged attention with device positions and a
    staging-length bucket. Not batch invariant, so not bitwise: per sample, the logprobs up to the first
    token where the two runs part are within bf16 noise, and most samples never part."""
    from megatron_iso.parallel.world import launched_world
    from tests.inference import engine_cases

    with launched_world(seed=7):
        _, _, _, eng, eager, captured = _eager_and_captured("performance", "bf16")
        assert not eng.decode_graphs.paged
        same, worst = engine_cases.captured_vs_eager(eager, captured)
        print(f"native captured vs eager: {same}/{len(eager)} samples identical, max |dlogp| {worst:.3e}")
        assert same >= len(eager) // 2 and worst < 5e-2, (same, worst)


# The small hybrid's geometry (GDN 16 key / 32 value heads of 128, chunk 64, gated attention heads of 256, bf16) with
# a dense MLP instead of its MoE layers (those are not captured), four layers: three GDN, one attention.
HYBRID = [
    "model=qwen3p5_small_hybrid_moe",
    "model.num_layers=4",
    "model.num_experts=null",
    "model.moe_topk=null",
    "model.shared_expert_ffn_hidden_size=null",
    "model.shared_expert_gate=false",
]


def test_captured_hybrid_decode_gives_the_eager_bits() -> None:
    """GDN layers in the graph: each row's state slot a static input, padding rows on the scratch slot, the chunk
    form's decode plan built on the device. Samples of shared prompts fork their state (copy on write between steps),
    sequences join and leave at different steps, and decode closes and opens 64-token chunks."""
    from megatron_iso.parallel.world import launched_world
    from tests.inference import engine_cases

    with launched_world(seed=7):
        tc, model = engine_cases.setup(["profile=correctness", *HYBRID])
        assert tc.iso_gdn_form == "chunk" and not tc.num_moe_experts
        specs = [
            (rid, n, {**kw, "max_new_tokens": 5 + 3 * (i % 4)}) for i, (rid, n, kw) in enumerate(engine_cases.SPECS)
        ]
        specs += [
            (201, 150, {"max_new_tokens": 40}),  # decode crosses position 192
            (202, 60, {"n": 4, "max_new_tokens": 30}),  # a group forking one prompt's state; crosses 64
            (203, 120, {"max_new_tokens": 24}),  # crosses 128
        ]
        reqs = engine_cases.requests(tc.vocab_size, specs)
        _, eager = _generate(model, reqs, graphs=False)
        eng, captured = _generate(model, reqs, graphs=True)
        graphs = eng.decode_graphs
        assert graphs is not None, eng.decode_graphs_off
        assert graphs.disabled is None, graphs.disabled
        assert graphs.gdn is eng.gdn and graphs.captures >= 2 and graphs.replays > 0, (graphs.captures, graphs.replays)
        engine_cases.assert_same_outputs(eager, captured, "hybrid eager vs captured")
        assert eng.gdn.free_units() == eng.gdn.capacity()  # every slot back; the scratch slot was never one
