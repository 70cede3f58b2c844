"""Paged KV reads of the Triton attention under TRITON_INTERPRET=1 (tiny shapes; skipped without triton).

``attention_with_paged_kv_cache`` reads keys through the block table and writes the new k/v straight
into the pool; ``attention_with_kv_cache`` on the step's staging view (``PagedStepView.layer`` +
``finish``) is the path it replaces. Both run the same tiles over the same key values, so the outputs
and the pool after the step must be the same bits: checked over shuffled, non-contiguous blocks,
sequences of different lengths, prefill from 0, chunked prefill and decode steps, GQA groups 2/3/4,
a gate, fp32 and bf16, block sizes equal to, a multiple of, and smaller / not dividing the kv tile
(per-key table reads), and block-table rows that are not in sequence order.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.inference.kv_blocks import PagedKVCache
    from megatron_iso.ops.attention import attention_triton as at
    from megatron_iso.ops.attention.kv_cache import KVStepPlan, PagedKVLayer
    from megatron_iso.testing.bits import same_bits

    KV_BLOCK, D = 16, 16
    # (query heads, kv heads, pool block size, dtype, gated)
    CASES = ((4, 2, 16, torch.float32, True), (8, 2, 32, torch.float32, False),
             (4, 2, 8, torch.bfloat16, True), (6, 2, 5, torch.float32, False))
    # Steps of 3 sequences: prefill from 0, a chunk each, then decode (lengths differ throughout).
    STEPS = ([7, 20, 1], [5, 30, 12], [1, 1, 1], [1, 1, 1])
    checked = 0
    for hq, hkv, bs, dtype, gated in CASES:
        g = torch.Generator().manual_seed(hq * 100 + bs)
        cache = PagedKVCache([0], 40, bs, hkv, D, dtype=dtype, prefix_caching=False)
        perm = torch.randperm(40, generator=g).tolist()
        cache._free = perm  # shuffled allocation: every table is non-contiguous and out of order
        # Garbage (NaN) in every pool row nobody has written: a key past kv_len must never be read.
        for pool in (cache.k[0], cache.v[0]):
            pool.fill_(float("nan"))
        ids = [10, 11, 12]
        for s in ids:
            cache.admit(s, [], 0)
        lens = [0, 0, 0]
        for counts in STEPS:
            starts = list(lens)
            for s, a, c in zip(ids, starts, counts):
                cache.prepare_append(s, a, c)
            cu = [0]
            for c in counts:
                cu.append(cu[-1] + c)
            T = cu[-1]
            q = torch.randn(T, hq, D, generator=g).to(dtype)
            k = torch.randn(T, hkv, D, generator=g).to(dtype)
            v = torch.randn(T, hkv, D, generator=g).to(dtype)
            gate = torch.randn(T, hq, D, generator=g).to(dtype) if gated else None
            cu_t, st_t, sl_t = torch.tensor(cu), torch.tensor(starts), torch.arange(3)
            before = (cache.k[0].clone(), cache.v[0].clone())

            view = cache.step_view(ids, starts, counts)
            kc, vc = view.layer(0)
            staged = at.attention_with_kv_cache(q, k, v, kc, vc, st_t, cu_t, slots=sl_t, gate=gate,
                                                kv_block=KV_BLOCK, plan=KVStepPlan(cu, starts, [0, 1, 2]))
            view.finish()
            after = (cache.k[0].clone(), cache.v[0].clone())

            cache.k[0].copy_(before[0])
            cache.v[0].copy_(before[1])
            view = cache.step_view(ids, starts, counts)
            paged = at.attention_with_paged_kv_cache(q, k, v, view.paged_layer(0), st_t, cu_t, slots=sl_t,
                                                     gate=gate, kv_block=KV_BLOCK,
                                                     plan=KVStepPlan(cu, starts, [0, 1, 2]))
            view.finish()  # nothing staged: a no-op
            tag = (hq, hkv, bs, dtype, counts)
            assert not torch.isnan(paged.float()).any(), tag
            assert same_bits(paged, staged), ("paged output != staged output", tag)
            assert same_bits(cache.k[0], after[0]) and same_bits(cache.v[0], after[1]), ("pool differs", tag)

            # Block-table rows in another order than the sequences (slot i -> row perm[i]), no plan.
            layer = view.paged_layer(0)
            order = [2, 0, 1]
            rows = torch.empty_like(layer.block_tables)
            for i, r in enumerate(order):
                rows[r] = layer.block_tables[i]
            cache.k[0].copy_(before[0])
            cache.v[0].copy_(before[1])
            moved = at.attention_with_paged_kv_cache(
                q, k, v, PagedKVLayer(cache.k[0], cache.v[0], rows, layer.write_idx), st_t, cu_t,
                slots=torch.tensor(order), gate=gate, kv_block=KV_BLOCK)
            assert same_bits(moved, staged), ("permuted table rows", tag)
            assert same_bits(cache.k[0], after[0]) and same_bits(cache.v[0], after[1]), ("pool differs (rows)", tag)
            lens = [a + c for a, c in zip(starts, counts)]
            checked += 1

    # Clear errors for inputs that do not fit.
    cache = PagedKVCache([0], 4, 16, 2, D, dtype=torch.float32)
    cache.admit(1, [], 0)
    cache.prepare_append(1, 0, 3)
    view = cache.step_view([1], [0], [3])
    q, k, v = torch.randn(3, 4, D), torch.randn(3, 2, D), torch.randn(3, 2, D)
    layer = view.paged_layer(0)
    for bad, msg in (
        (dict(cache_seqlens=torch.tensor([14])), "needs 17 positions"),
        (dict(slots=torch.tensor([1])), "not a block-table row"),
    ):
        kw = dict(cache_seqlens=torch.tensor([0]), slots=None, **{})
        kw.update(bad)
        try:
            at.attention_with_paged_kv_cache(q, k, v, layer, kw["cache_seqlens"], torch.tensor([0, 3]),
                                             slots=kw["slots"], kv_block=KV_BLOCK)
        except ValueError as e:
            assert msg in str(e), str(e)
        else:
            raise AssertionError(f"no error for {bad}")
    try:
        at.attention_with_paged_kv_cache(q, k, v, PagedKVLayer(layer.k_pool, layer.v_pool, layer.block_tables.float(),
                                                                layer.write_idx), torch.tensor([0]), torch.tensor([0, 3]))
    except ValueError as e:
        assert "block_tables" in str(e), str(e)
    else:
        raise AssertionError("float block table accepted")
    print("steps checked:", checked)
    print("ok")
    """
)


def test_paged_reads_equal_staged_reads_under_interpreter():
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
    assert "steps checked: 16" in res.stdout, res.stdout
