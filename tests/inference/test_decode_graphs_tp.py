"""Decode steps from the DecodeGraphs buckets at tensor parallelism 2 (gloo ranks in lockstep), run eagerly on CPU
from the static bucket buffers (``enable_decode_graphs(capture=False)``), with the paged kernel's contract stand-in
of tests/inference/test_decode_graphs.py.

The claims: on every rank, the tokens and logprobs are the eager TP 2 engine's bits and the TP 1 engine's bits, for a
dense model, a GDN hybrid and an MoE model (EP 1), with sequences joining and leaving at different steps and padded
buckets. A bucket step reads nothing from the device on the host at TP 2 (dense and MoE: the vocab-parallel
embedding, the row-parallel tree all-reduces, the vocab-parallel scoring and the Gumbel draw across vocab shards move
device tensors of static shapes only), so its cross-rank work is collectives alone, which NCCL lets a CUDA graph
capture; the counter does see a read of a collective's output. (The hybrid is left out of the read count: on CPU its
GDN layers run the reference ops, which plan on the host; a GPU runs the chunk form's device-planned kernels.) TP 2
graphs are allowed over an NCCL group only. The captured graphs over NCCL: tests/multigpu/test_decode_graphs_tp.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases

MODELS = {
    "tiny_dense": ["profile=correctness"],
    "tiny_hybrid": ["profile=correctness", "model=tiny_hybrid", "profile.gdn_chunk=4"],
    "tiny_moe": ["profile=correctness", "model=tiny_moe"],
}


def _generate(overrides: list[str], buckets: list[int] | None, *, static: bool) -> tuple[dict, int, int]:
    """:func:`engine_cases.staggered_run` of the model: the outputs' summary, the engine's steps and the decode steps
    served from bucket buffers."""
    _, model = engine_cases.setup(overrides)
    run = engine_cases.staggered_run(model, static=static, buckets=buckets)
    return run.summary, run.engine.stats.steps, run.static_steps


def _runs(overrides: list[str], static: bool) -> dict:
    """The eager engine's run and (``static``) the bucket buffers' runs, default buckets and 2/5/6 (padded steps)."""
    runs = {"eager": _generate(overrides, None, static=False)}
    if static:
        runs["static"] = _generate(overrides, None, static=True)
        runs["padded"] = _generate(overrides, [2, 5, 6], static=True)
    return runs


@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_bucket_decode_steps_give_the_eager_and_tp1_bits(model: str) -> None:
    over = MODELS[model]
    tp1 = run_on_ranks(_runs, 1, args=(over, False))[0]["eager"][0]
    tp2 = run_on_ranks(_runs, 2, tp=2, args=([*over, "parallel.tp=2"], True))
    assert len(tp1) >= 8
    for rank, runs in enumerate(tp2):
        engine_cases.assert_same_outputs(tp1, runs["eager"][0], f"{model} rank {rank}: eager TP 2 vs TP 1")
        assert runs["eager"][2] == 0
        for name in ("static", "padded"):
            summary, steps, static_steps = runs[name]
            engine_cases.assert_same_outputs(
                runs["eager"][0], summary, f"{model} rank {rank}: {name} TP 2 vs eager TP 2"
            )
            # Every step but the (at most 8, one per request) prefill steps came from bucket buffers.
            assert static_steps >= steps - 8 > 0, (model, rank, name, static_steps, steps)


def _bucket_step_reads(overrides: list[str]) -> dict:
    """Host reads of device tensors inside the bucket decode steps of a short run (4 requests), and a read the
    counter must see: one of a TP collective's output."""
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from megatron_iso.models import modules
    from megatron_iso.parallel.tree_collectives import gather_along, tree_all_reduce
    from megatron_iso.testing.host_reads import HostReadCounter

    tc, model = engine_cases.setup(overrides)
    standin = engine_cases.paged_kernel_standin([])
    saved = (modules.paged_kv_reads, modules.attention_with_paged_kv_cache)
    reads: list = []
    with HostReadCounter() as counter:

        def kernel(*args, **kwargs):
            # The stand-in reads the host plan back on CPU (the kernel reads the same tensors on the device): its
            # reads are not the step's.
            n = len(counter.reads)
            try:
                return standin(*args, **kwargs)
            finally:
                del counter.reads[n:]

        modules.paged_kv_reads = lambda q, profile: profile == "correctness"
        modules.attention_with_paged_kv_cache = kernel
        try:
            counter.seed(model)
            eng = RolloutEngine(model, EngineConfig(max_num_seqs=4, kv_cache_bytes=1 << 20, block_size=4))
            graphs = eng.enable_decode_graphs(capture=False)
            real_step = graphs.decode_step

            def counted(*args, **kwargs):
                counter.clear()
                out = real_step(*args, **kwargs)
                reads.append(counter.summary())
                return out

            graphs.decode_step = counted
            reqs = engine_cases.requests(tc.vocab_size, engine_cases.SPECS[:4], max_new_tokens=4)
            engine_cases.run_schedule(eng, reqs, [0, 0, 1, 1])
            # The counter sees a host read of a collective's output (so an empty record above is not blindness).
            counter.clear()
            x = torch.ones(2, 3, device="cpu")
            tree_all_reduce(x, eng.drawer._common()["group"]).tolist()
            gather_along(x, eng.drawer._common()["group"], dim=-1)[0, 0].item()
            seen = sorted(r.kind for r in counter.reads)
        finally:
            modules.paged_kv_reads, modules.attention_with_paged_kv_cache = saved
    return {"steps": reads, "seen": seen}


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
def test_tp2_bucket_decode_step_reads_nothing_back(model: str) -> None:
    for rank, res in enumerate(run_on_ranks(_bucket_step_reads, 2, tp=2, args=([*MODELS[model], "parallel.tp=2"],))):
        assert len(res["steps"]) >= 3, (rank, res["steps"])
        assert all(step == {} for step in res["steps"]), (model, rank, res["steps"])
        assert res["seen"] == ["item", "tolist"], (rank, res["seen"])


def _support_at_tp2() -> dict[str, str | None]:
    """``decode_graph_support`` for a TP 2 model on a CUDA device (a stand-in: only the parameters' device is read)
    over this gloo TP group, and over one reported as NCCL."""
    from types import SimpleNamespace

    from megatron_iso.inference import cuda_graphs
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.settings.compose import load_config

    tc = transformer_config(load_config(["profile=correctness", "parallel.tp=2"]))
    on_cuda = SimpleNamespace(config=tc, parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda", 0))]))
    out = {"gloo": cuda_graphs.decode_graph_support(on_cuda, paged_kv_reads=True)}
    real = cuda_graphs.tp_backend
    cuda_graphs.tp_backend = lambda: "nccl"
    try:
        out["nccl"] = cuda_graphs.decode_graph_support(on_cuda, paged_kv_reads=True)
    finally:
        cuda_graphs.tp_backend = real
    out["backend"] = real()
    return out


def test_tp2_decode_graphs_need_an_nccl_group() -> None:
    got = run_on_ranks(_support_at_tp2, 2, tp=2)[0]
    assert got["backend"] == "gloo"
    assert got["gloo"] is not None and "'gloo'" in got["gloo"] and "'nccl'" in got["gloo"], got["gloo"]
    assert got["nccl"] is None
