"""The engine's CUDA correctness path reads the paged KV pool in place (no staging), checked on CPU.

On CPU the attention dispatch stages the pool (the reference kernel takes a contiguous cache). Here
``paged_kv_reads`` is made to answer as on CUDA, and the Triton paged call is replaced by a stand-in
that attends through exactly the block tables and write rows the engine hands the kernel (gather the
table's blocks, reference attention, write the new k/v at ``write_idx``). The claims: every
attention layer of every step takes the paged call and the staging view is never built; the write
rows are the table's rows of the new positions; and rollout tokens and logprobs are the bits of the
staged engine, with prefix hits, forks (copy-on-write) and staggered arrivals. The Triton kernel's
own paged == staged claim is tests/ops/test_attention_paged_interpret.py (and the GPU test).
"""

from __future__ import annotations

import torch

from megatron_iso.testing.harness import run_on_ranks


def _standin(calls: list):
    from megatron_iso.ops.attention import KVStepPlan, attention_with_kv_cache

    def paged_call(q, k, v, paged, cache_seqlens, cu_seqlens_q, *, slots, plan, **common):
        assert common.pop("profile") == "correctness"
        bs, width = paged.block_size, paged.block_tables.shape[1]
        rows = paged.block_tables[slots]  # the row of each sequence, as the kernel reads it
        idx = (rows[:, :, None] * bs + torch.arange(bs)).reshape(len(plan.starts), width * bs)
        kp, vp = paged.k_pool.flatten(0, 1), paged.v_pool.flatten(0, 1)
        kc = kp[idx.reshape(-1)].view(len(plan.starts), width * bs, *kp.shape[1:])
        vc = vp[idx.reshape(-1)].view(len(plan.starts), width * bs, *vp.shape[1:])
        seq = torch.repeat_interleave(torch.arange(len(plan.starts)), torch.tensor(plan.lengths))
        at = torch.tensor(plan.starts)[seq] + torch.arange(q.shape[0]) - torch.tensor(plan.cu[:-1])[seq]
        assert torch.equal(paged.write_idx, idx[seq, at]), "write rows are not the table's rows of the new positions"
        own = KVStepPlan(plan.cu, plan.starts, list(range(len(plan.starts))))
        out = attention_with_kv_cache(
            q, k, v, kc, vc, cache_seqlens, cu_seqlens_q, slots=torch.arange(len(plan.starts)), plan=own, **common
        )
        rows_written = (seq * width * bs + at).long()
        kp.index_copy_(0, paged.write_idx, kc.flatten(0, 1)[rows_written])
        vp.index_copy_(0, paged.write_idx, vc.flatten(0, 1)[rows_written])
        calls.append(int(q.shape[0]))
        return out

    return paged_call


def _run(paged: bool, engine_allows: bool = True) -> tuple[dict, int, int, int]:
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from megatron_iso.inference.kv_blocks import PagedStepView
    from megatron_iso.models import modules
    from tests.inference import engine_cases

    tc, model = engine_cases.setup(["profile=correctness"])
    calls: list[int] = []
    saved = (modules.paged_kv_reads, modules.attention_with_paged_kv_cache, PagedStepView.layer)
    if paged:

        def no_staging(self, index):
            raise AssertionError("the paged path built a staging view")

        modules.paged_kv_reads = lambda q, profile: profile == "correctness"  # as on CUDA
        modules.attention_with_paged_kv_cache = _standin(calls)
        if engine_allows:
            PagedStepView.layer = no_staging
    try:
        reqs = engine_cases.requests(tc.vocab_size, max_new_tokens=5)
        knobs = {"kv_cache_bytes": 1 << 20, "block_size": 4, "paged_kv_reads": engine_allows}
        eng = RolloutEngine(model, EngineConfig(max_num_seqs=4, **knobs))
        outs = engine_cases.run_schedule(eng, reqs, engine_cases.STAGGERED_ARRIVALS)
        again = RolloutEngine(model, EngineConfig(**knobs))
        outs += again.generate(reqs[:3]) + again.generate(reqs[:3])  # the second call hits the prefix cache
        hits = again.stats.prefix_hit_tokens
        steps = eng.stats.steps + again.stats.steps
    finally:
        modules.paged_kv_reads, modules.attention_with_paged_kv_cache, PagedStepView.layer = saved
    summary = {(i, key): val for i, o in enumerate(outs) for key, val in engine_cases.summary([o]).items()}
    return summary, len(calls), steps * tc.num_layers, hits


def _both() -> dict:
    return {"staged": _run(False), "paged": _run(True), "switched_off": _run(True, engine_allows=False)}


def test_cuda_path_reads_the_pool_in_place() -> None:
    res = run_on_ranks(_both, 1)[0]
    staged, _, _, _ = res["staged"]
    paged, calls, layer_steps, hits = res["paged"]
    assert calls == layer_steps and calls > 0, (calls, layer_steps)
    assert hits > 0, "no prefix hit exercised"
    assert staged.keys() == paged.keys()
    for key, (tok, lp, reason) in staged.items():
        tok2, lp2, reason2 = paged[key]
        assert tok == tok2 and reason == reason2, key
        assert torch.equal(lp.view(torch.int32), lp2.view(torch.int32)), key
    # EngineConfig(paged_kv_reads=False): the kernel could read in place, the engine stages instead.
    off, off_calls, _, _ = res["switched_off"]
    assert off_calls == 0
    assert all(torch.equal(staged[k][1].view(torch.int32), off[k][1].view(torch.int32)) for k in staged)


def test_paged_reads_refused_off_the_triton_path() -> None:
    from megatron_iso.ops.attention import attention_with_paged_kv_cache, paged_kv_reads

    q = torch.zeros(1, 2, 8)
    assert not paged_kv_reads(q, "correctness") and not paged_kv_reads(q, "performance")
    try:
        attention_with_paged_kv_cache(q, q[:, :1], q[:, :1], None, torch.tensor([0]), torch.tensor([0, 1]))
    except ValueError as e:
        assert "'cuda'" in str(e) and "'cpu'" in str(e), str(e)
    else:
        raise AssertionError("paged reads accepted on cpu")
