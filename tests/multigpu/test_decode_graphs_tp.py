"""Decode graphs captured at TP 2 over NCCL (one torchrun rank per GPU): the engine replaying CUDA graphs whose
steps hold the TP collectives gives the eager TP 2 engine's tokens and logprobs bit for bit on every rank (mixed
prompt lengths, sequences leaving at different steps, staggered arrivals, several buckets), and the TP 1 engine's.

Models: a dense model (tiny_dense widened to the GPU GEMM's tiles, as tests/multigpu/test_nccl_invariance.py), the
small hybrid's GDN geometry with a dense MLP (tests/gpu/test_decode_graphs.py) and tiny_moe widened
(tests/gpu/test_moe_static_graph.py), EP 1. Skipped without two GPUs; the CPU half (the same buffers run eagerly on
gloo ranks, and their host reads) is tests/inference/test_decode_graphs_tp.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_iso.parallel.torchrun import run_under_torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)"
    ),
]

DENSE = ["model.ffn_hidden_size=512", "model.kv_channels=64", "model.params_dtype=bf16"]
HYBRID = [
    "model=qwen3p5_small_hybrid_moe",
    "model.num_layers=4",
    "model.num_experts=null",
    "model.moe_topk=null",
    "model.shared_expert_ffn_hidden_size=null",
    "model.shared_expert_gate=false",
]
MOE = [
    "model=tiny_moe",
    "model.kv_channels=64",
    "model.ffn_hidden_size=512",
    "model.moe_ffn_hidden_size=512",
    "model.shared_expert_ffn_hidden_size=512",
]
MODELS = {"dense": DENSE, "hybrid": HYBRID, "moe": MOE}


def _requests(vocab: int):
    from tests.inference import engine_cases

    specs = [(rid, n, {**kw, "max_new_tokens": 5 + 3 * (i % 4)}) for i, (rid, n, kw) in enumerate(engine_cases.SPECS)]
    # and long ones (one request per entry of the GPU test's arrival schedule): decode crosses 64-key tiles, blocks
    # of 16 and 64-token GDN chunks, and a group of 4 samples forks one prompt
    specs += [
        (201, 150, {"max_new_tokens": 40}),
        (202, 60, {"n": 4, "max_new_tokens": 30}),
        (203, 120, {"max_new_tokens": 24}),
    ]
    return engine_cases.requests(vocab, specs)


def _eager_and_captured(overrides: list[str], captured: bool) -> dict[str, Any]:
    """This rank's world, the eager engine's outputs, and (``captured``) the graph-replaying engine's outputs and
    graph counts."""
    import torch.distributed as dist

    from tests.gpu.test_decode_graphs import _generate
    from tests.inference import engine_cases

    tc, model = engine_cases.setup(["profile=correctness", *overrides])
    reqs = _requests(tc.vocab_size)
    out: dict[str, Any] = {
        "world": (
            str(dist.get_backend()),
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu",
        ),
        "eager": _generate(model, reqs, graphs=False)[1],
    }
    if captured:
        eng, out["captured"] = _generate(model, reqs, graphs=True)
        graphs = eng.decode_graphs
        out["status"] = eng.decode_graphs_status()
        out["counts"] = None if graphs is None else (graphs.captures, graphs.replays, graphs.disabled)
    return out


@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_captured_decode_gives_the_eager_and_tp1_bits(model: str) -> None:
    from tests.gpu.test_decode_graphs import _same_bits

    over = MODELS[model]
    tp1 = run_under_torchrun(_eager_and_captured, 1, args=(over, False))[0]["eager"]
    tp2 = run_under_torchrun(_eager_and_captured, 2, tp=2, args=([*over, "parallel.tp=2"], True))
    for rank, res in enumerate(tp2):
        assert res["world"] == ("nccl", f"cuda:{rank}"), res["world"]
        assert res["counts"] is not None, res["status"]  # decode_graph_support allowed TP 2 over NCCL
        captures, replays, disabled = res["counts"]
        assert disabled is None and captures >= 2 and replays > 0, res["status"]
        _same_bits(res["eager"], res["captured"])  # replayed == eager, TP 2
        _same_bits(tp1, res["eager"])  # TP 2 == TP 1
