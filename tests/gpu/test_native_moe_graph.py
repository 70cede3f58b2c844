"""The performance profile's MoE decode in CUDA graphs (``models.moe_serving``: Megatron's router, a device sort of the
slots, torch's grouped GEMM, Megatron's unpermute) on a GPU.

- The layer: the static dispatch of one MoE layer on a 24-row bucket captured once (bf16: torch's CUTLASS grouped
  GEMM on sm90 / sm100; fp32: the masked fallback), replayed with new rows, new routings (the counts change under the
  same graph; a zero router puts every row on the same experts) and new expert weights refreshed into the serving
  copy in place: every replay equals the eager dispatch on the same bucket (top-2: a token's two expert rows add
  into a zero row in either order with the same bits), and Megatron's MoELayer within bf16 / fp32 rounding. The
  eager dispatch runs under ``torch.cuda.set_sync_debug_mode("error")``: no host read.
- The engine: native tiny_moe decode steps are captured (``decode_graph_support`` no longer refuses them) and stay
  close to the eager engine (the native profile is not batch invariant: padding rows and the staging length may
  move last bits, so most samples are identical and logprobs agree within bf16 noise up to the first difference).

The CPU half: tests/models/test_moe_serving.py, tests/inference/test_decode_graphs_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BUCKET = 24
# tiny_moe with widths of 16-byte rows everywhere and enough experts to leave some empty in a bucket.
SHAPES = ["model=tiny_moe", "model.num_experts=16", "model.moe_ffn_hidden_size=64"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_captured_native_moe_layer_replays_the_eager_dispatch(dtype: str) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_iso.models.moe_serving import NativeMoELayer
    from megatron_iso.ops.gemm.grouped_stock import library_kernel_serves
    from megatron_iso.parallel.world import launched_world
    from tests.inference import engine_cases

    with launched_world(seed=7):
        tc, model = engine_cases.setup(["profile=performance", *SHAPES, f"model.params_dtype={dtype}"])
        moe = model.decoder.layers[0].mlp
        assert isinstance(moe, NativeMoELayer) and moe.static_unsupported is None
        h = tc.hidden_size
        static_x = torch.zeros(BUCKET, 1, h, device="cuda", dtype=tc.params_dtype)
        fc1, _ = moe.expert_stack.weights()
        probe = torch.zeros(BUCKET * tc.moe_router_topk, h, device="cuda", dtype=tc.params_dtype)
        cutlass = dtype == "bf16" and torch.cuda.get_device_capability()[0] in (9, 10)
        assert library_kernel_serves(probe, fc1) == cutlass
        with torch.no_grad():
            torch.cuda.set_sync_debug_mode("error")
            try:
                moe.serve(static_x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    moe.serve(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = moe.serve(static_x)
            addresses = [t.data_ptr() for t in moe.expert_stack.tensors()]
            cases = 0
            for routing in ("random", "new expert weights", "zero router"):
                if routing == "new expert weights":
                    for p in moe.experts.parameters():
                        p.mul_(-0.75)  # in place, as an optimizer step; then the engine's refresh
                    moe.expert_stack.refresh()
                    assert [t.data_ptr() for t in moe.expert_stack.tensors()] == addresses
                elif routing == "zero router":
                    moe.router.weight.zero_()
                for seed, n in enumerate((1, 5, 17, BUCKET)):
                    g = torch.Generator(device="cuda").manual_seed(100 + seed)
                    x = torch.randn(BUCKET, 1, h, device="cuda", generator=g).to(tc.params_dtype)
                    x[n:] = 0
                    static_x.copy_(x)
                    graph.replay()
                    eager = moe.serve(x)
                    assert torch.equal(bits(static_out), bits(eager)), (dtype, routing, n)
                    ref = MoELayer.forward(moe, x[:n])[0].float()
                    # relative to the output's scale
                    atol = (3e-2 if dtype == "bf16" else 2e-3) * float(ref.abs().max())
                    torch.testing.assert_close(static_out[:n].float(), ref, rtol=0.0, atol=atol)
                    cases += 1
            assert cases == 12


def _generate(model, reqs, graphs: bool):
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from tests.gpu.test_decode_graphs import ARRIVALS
    from tests.inference import engine_cases

    cfg = EngineConfig(max_num_seqs=6, kv_cache_bytes=96 << 20, block_size=16, cuda_graphs=graphs)
    eng = RolloutEngine(model, cfg)
    outs = engine_cases.run_schedule(eng, reqs, ARRIVALS)
    return eng, engine_cases.summary(outs)


def test_native_moe_decode_is_captured_and_stays_close_to_eager() -> None:
    from megatron_iso.parallel.world import launched_world
    from tests.inference import engine_cases

    with launched_world(seed=7):
        tc, model = engine_cases.setup(["profile=performance", *SHAPES, "model.params_dtype=bf16"])
        specs = [
            (rid, n, {**kw, "max_new_tokens": 5 + 3 * (i % 4)}) for i, (rid, n, kw) in enumerate(engine_cases.SPECS)
        ]
        specs += [(201, 150, {"max_new_tokens": 30}), (202, 240, {"max_new_tokens": 40})]  # staging 256 -> 512
        reqs = engine_cases.requests(tc.vocab_size, specs)
        _, eager = _generate(model, reqs, graphs=False)
        eng, captured = _generate(model, reqs, graphs=True)
        graphs = eng.decode_graphs
        assert graphs is not None, eng.decode_graphs_off
        assert graphs.disabled is None, graphs.disabled
        assert graphs.captures >= 2 and graphs.replays > 0, (graphs.captures, graphs.replays)
        same, worst = engine_cases.captured_vs_eager(eager, captured)
        print(f"native MoE captured vs eager: {same}/{len(eager)} samples identical, max |dlogp| {worst:.3e}")
        assert same >= len(eager) // 2 and worst < 5e-2, (same, worst)
