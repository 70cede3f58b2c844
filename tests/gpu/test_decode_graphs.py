"""Captured decode graphs on a CUDA device: the engine replaying CUDA graphs gives the eager engine's
tokens and logprobs bit for bit (mixed prompt lengths, sequences leaving at different steps, staggered
arrivals, several buckets, a weight update in place between generations). The CPU half of the claim
(bucket buffers, padding, device-read positions) is tests/inference/test_decode_graphs.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


def _generate(model, reqs, graphs: bool):
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from tests.inference import engine_cases

    cfg = EngineConfig(max_num_seqs=6, kv_cache_bytes=32 << 20, block_size=16, cuda_graphs=graphs)
    eng = RolloutEngine(model, cfg)
    outs = engine_cases.run_schedule(eng, reqs, [0, 0, 1, 3, 4, 4, 6, 9])
    return eng, engine_cases.summary(outs)


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, (tok, lp, reason) in a.items():
        tok2, lp2, reason2 = b[key]
        assert tok == tok2 and reason == reason2, key
        assert torch.equal(lp.view(torch.int32), lp2.view(torch.int32)), key


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_captured_decode_gives_the_eager_bits(dtype: str) -> None:
    from megatron_iso.models.weights import load_hf_state_dict, random_hf_state_dict
    from megatron_iso.parallel.world import launched_world
    from tests.inference import engine_cases

    with launched_world(seed=7):
        # Qwen3-0.6B shapes (the Triton GEMM's tiles need real widths), two layers.
        shape = ["model=qwen3_0p6b", "model.num_layers=2", f"model.params_dtype={dtype}"]
        tc, model = engine_cases.setup(["profile=correctness", *shape])
        specs = [
            (rid, n, {**kw, "max_new_tokens": 5 + 3 * (i % 4)}) for i, (rid, n, kw) in enumerate(engine_cases.SPECS)
        ]
        reqs = engine_cases.requests(tc.vocab_size, specs)
        _, eager = _generate(model, reqs, graphs=False)
        eng, captured = _generate(model, reqs, graphs=True)
        graphs = eng.decode_graphs
        assert graphs is not None, eng.decode_graphs_off
        assert graphs.disabled is None, graphs.disabled
        assert graphs.captures >= 2 and graphs.replays > 0, (graphs.captures, graphs.replays)
        _same_bits(eager, captured)

        # New weights copied in place (the colocated trainer's case): the graphs stay valid.
        load_hf_state_dict(model, random_hf_state_dict(tc, seed=11), tc)
        eng.on_weights_updated()
        assert not graphs.parameters_moved()
        again = engine_cases.summary(engine_cases.run_schedule(eng, reqs, [0, 0, 1, 3, 4, 4, 6, 9]))
        _, fresh = _generate(model, reqs, graphs=False)
        _same_bits(fresh, again)
