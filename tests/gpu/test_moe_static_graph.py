"""MoE decode forward captured in a CUDA graph (the static-shape path, ``models.moe.static_shapes``) gives
the eager forward's bits on a GPU.

- The layer: one MoE layer's static forward on a 24-row bucket captured once, then replayed with new
  rows and new routings (the counts change under the same graph: empty experts, every row on the same
  two experts after the router is zeroed in place), rows ``:n`` equal to the eager layer on the n real
  rows alone, bit for bit, for several n; padding rows hold zeros and huge values.
- The engine: tiny_moe's decode steps replayed from captured bucket graphs (their batches carry
  ``IsoBatch.static_shapes``) give the eager engine's tokens and logprobs bit for bit.

Shapes: tiny_moe widened so that every GEMM's leaf depth is a whole number of Triton K tiles
(``settings.check_gpu_gemm_shapes``). The CPU half: tests/models/test_moe_static_shapes.py and
tests/inference/test_decode_graphs_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

SHAPES = [
    "model=tiny_moe",
    "model.kv_channels=64",
    "model.ffn_hidden_size=512",
    "model.moe_ffn_hidden_size=512",
    "model.shared_expert_ffn_hidden_size=512",
]
BUCKET = 24


def _model(dtype: str):
    from tests.inference import engine_cases

    return engine_cases.setup(["profile=correctness", *SHAPES, f"model.params_dtype={dtype}"])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_captured_moe_layer_gives_the_eager_bits(dtype: str) -> None:
    from megatron_iso.models.moe import static_shapes
    from megatron_iso.parallel.world import launched_world

    with launched_world(seed=7):
        tc, model = _model(dtype)
        moe = model.decoder.layers[0].mlp
        assert moe.experts._can_group(torch.zeros(1, device="cuda"))
        h = tc.hidden_size
        static_x = torch.zeros(BUCKET, 1, h, device="cuda", dtype=tc.params_dtype)
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), static_shapes():
                for _ in range(2):
                    moe(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), static_shapes():
                static_out = moe(static_x)[0]
            cases = 0
            for routing in ("random", "zero router"):
                if routing == "zero router":
                    moe.router.weight.zero_()  # in place: the graph reads the same storage
                for seed, n in enumerate((1, 2, 5, 17, BUCKET)):
                    g = torch.Generator(device="cuda").manual_seed(100 + seed)
                    x = torch.randn(BUCKET, 1, h, device="cuda", generator=g).to(tc.params_dtype)
                    x[n:] = 0
                    x[n + 2 :] = 1e4
                    static_x.copy_(x)
                    graph.replay()
                    eager = moe(x[:n])[0]
                    assert torch.equal(bits(static_out[:n]), bits(eager)), (dtype, routing, n)
                    # and the whole bucket, eagerly, padding rows included
                    assert torch.equal(bits(static_out), bits(moe(x)[0])), (dtype, routing, n)
                    cases += 1
            assert cases == 10


def _generate(model, reqs, graphs: bool):
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from tests.gpu.test_decode_graphs import ARRIVALS
    from tests.inference import engine_cases

    eng = RolloutEngine(model, EngineConfig(max_num_seqs=6, kv_cache_bytes=96 << 20, block_size=16, cuda_graphs=False))
    if graphs:
        # Forced (decode_graph_support refused MoE models before the static path), with the bucket batches
        # marked static as DecodeGraphs marks them for a capturable MoE model.
        dg = eng.enable_decode_graphs(capture=True)
        real_run = dg._run

        def run(bucket):
            bucket.batch.static_shapes = True
            return real_run(bucket)

        dg._run = run
    outs = engine_cases.run_schedule(eng, reqs, ARRIVALS)
    return eng, engine_cases.summary(outs)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_captured_moe_decode_gives_the_eager_bits(dtype: str) -> None:
    from megatron_iso.parallel.world import launched_world
    from tests.gpu.test_decode_graphs import _same_bits
    from tests.inference import engine_cases

    with launched_world(seed=7):
        tc, model = _model(dtype)
        specs = [
            (rid, n, {**kw, "max_new_tokens": 5 + 3 * (i % 4)}) for i, (rid, n, kw) in enumerate(engine_cases.SPECS)
        ]
        # and longer ones (one per remaining arrival slot): decode crosses 64-key tiles and blocks of 16
        specs += [
            (201, 150, {"max_new_tokens": 30}),
            (202, 40, {"max_new_tokens": 24}),
            (203, 90, {"max_new_tokens": 20}),
        ]
        reqs = engine_cases.requests(tc.vocab_size, specs)
        _, eager = _generate(model, reqs, graphs=False)
        eng, captured = _generate(model, reqs, graphs=True)
        graphs = eng.decode_graphs
        assert graphs.disabled is None, graphs.disabled
        assert graphs.captures >= 2 and graphs.replays > 0, (graphs.captures, graphs.replays)
        _same_bits(eager, captured)
