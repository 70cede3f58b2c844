"""Bitwise claims of the Triton attention kernel (GPU correctness profile), on a CUDA device.

Prefill + decode == training (varlen) forward, chunked prefill, batch composition invariance, the decode
split over key segments == the one-launch schedule (eagerly and replayed from a CUDA graph), and accuracy
against an fp64 reference. Bit patterns compared, never tolerances (except accuracy).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
triton = pytest.importorskip("triton")

HQ, HKV, D = 8, 2, 128
DTYPES = (torch.bfloat16, torch.float32)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _qkvg(T, dtype, seed, hq=HQ, hkv=HKV, d=D):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(T, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv, hq)]


@pytest.fixture(scope="module")
def at():
    from megatron_iso.ops.attention import attention_triton

    return attention_triton


@pytest.fixture(scope="module")
def launch():
    from megatron_iso.ops.attention import forward_launch_triton

    return forward_launch_triton


def _cache(slots, max_len, dtype, hkv=HKV, d=D):
    # NaN-poisoned: keys past a sequence's length must never reach a product.
    return [torch.full((slots, max_len, hkv, d), float("nan"), device="cuda", dtype=dtype) for _ in range(2)]


def _run_chunks(at, q, k, v, gate, chunks, slot=1, slots=3):
    """Feed one sequence through the cache in the given chunk lengths; returns the concatenated output."""
    kc, vc = _cache(slots, q.shape[0] + 8, q.dtype, k.shape[1], q.shape[-1])
    outs, pos = [], 0
    for n in chunks:
        sl = slice(pos, pos + n)
        outs.append(
            at.attention_with_kv_cache(
                q[sl],
                k[sl],
                v[sl],
                kc,
                vc,
                torch.tensor([pos]),
                torch.tensor([0, n]),
                slots=torch.tensor([slot]),
                gate=None if gate is None else gate[sl],
            )
        )
        pos += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefill", [1, 63, 64, 65, 130])
def test_prefill_then_decode_equals_varlen(at, dtype, prefill):
    L = prefill + 70
    q, k, v, gate = _qkvg(L + 29, dtype, prefill)
    cu = torch.tensor([0, 29, L + 29])  # the sequence is the second of a pack
    train = at.attention_varlen(q, k, v, cu, gate=gate)[29:]
    got = _run_chunks(at, q[29:], k[29:], v[29:], gate[29:], [prefill] + [1] * 70)
    assert _same(got, train)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_head_prefill_then_decode_equals_varlen(at, dtype):
    # Head dim 256 (Qwen3.5 attention) runs the narrower wide-head tiles, which fit in shared memory.
    q, k, v, gate = _qkvg(200, dtype, 11, d=256)
    train = at.attention_varlen(q, k, v, torch.tensor([0, 200]), gate=gate)
    got = _run_chunks(at, q, k, v, gate, [65] + [1] * 135)
    assert _same(got, train)
    ref = _dense_fp64(q, k, v, torch.tensor([0, 200]), gate, 1 / math.sqrt(256))
    rel = float((train.double() - ref).norm() / ref.norm())
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-6), rel


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_varlen(at, dtype):
    q, k, v, _ = _qkvg(300, dtype, 7)
    train = at.attention_varlen(q, k, v, torch.tensor([0, 300]))
    for chunks in ([37, 64, 1, 100, 98], [128, 128, 44], [300]):
        assert _same(_run_chunks(at, q, k, v, None, chunks), train), chunks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_batch_composition_invariance(at, dtype, group):
    hkv = HQ // group
    lens = [5, 200, 1, 77, 64]
    q, k, v, gate = _qkvg(sum(lens), dtype, 11, HQ, hkv)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    packed = at.attention_varlen(q, k, v, cu, gate=gate)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone = at.attention_varlen(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), gate=gate[a:b])
        assert _same(alone, packed[a:b]), i
    # decode batch: each sequence's step is the same whoever shares the launch, in any order and slot
    kc, vc = _cache(8, 256, dtype, hkv)
    slots = torch.tensor([3, 0, 7, 5, 1])
    at.attention_with_kv_cache(q, k, v, kc, vc, torch.zeros(5, dtype=torch.long), cu, slots=slots, gate=gate)
    nq, nk, nv, ng = _qkvg(5, dtype, 12, HQ, hkv)
    lens_t = torch.tensor(lens)
    kc2, vc2 = kc.clone(), vc.clone()
    step = at.attention_with_kv_cache(nq, nk, nv, kc, vc, lens_t, torch.arange(6), slots=slots, gate=ng)
    for order in ([4, 2, 0], [1], [3, 1]):
        o = torch.tensor(order)
        part = at.attention_with_kv_cache(
            nq[o], nk[o], nv[o], kc2.clone(), vc2.clone(), lens_t[o], torch.arange(len(order) + 1),
            slots=slots[o], gate=ng[o],
        )  # fmt: skip
        assert _same(part, step[o]), order


def _dense_fp64(q, k, v, cu, gate, scale):
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qq = q[a:b].double().transpose(0, 1)
        kk = k[a:b].double().repeat_interleave(group, 1).transpose(0, 1)
        vv = v[a:b].double().repeat_interleave(group, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, device=q.device, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = (torch.softmax(s, -1) @ vv).transpose(0, 1)
    return out if gate is None else out * torch.sigmoid(gate.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_vs_fp64(at, dtype):
    lens = [1, 130, 513]
    q, k, v, gate = _qkvg(sum(lens), dtype, 13)
    cu = torch.tensor([0, 1, 131, 644])
    for g in (None, gate, gate[..., :1]):
        out = at.attention_varlen(q, k, v, cu, gate=g)
        ref = _dense_fp64(q, k, v, cu, g, 1 / math.sqrt(D))
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-6), rel


def test_dispatch_and_registry(at):
    from megatron_iso.ops import attention
    from megatron_iso.registry import lookup

    q, k, v, _ = _qkvg(70, torch.bfloat16, 14)
    cu = torch.tensor([0, 70])
    assert _same(attention.attention_varlen(q, k, v, cu), at.attention_varlen(q, k, v, cu))
    assert lookup("attention", "cuda", "correctness").impl_id == at.IMPL_ID
    assert lookup("attention_kvcache", "cuda", "correctness").impl_id == at.KVCACHE_IMPL_ID
    for probe in (
        lookup("attention", "cuda", "correctness").probe,
        lookup("attention_kvcache", "cuda", "correctness").probe,
    ):
        assert all(torch.isfinite(t).all() for t in probe().values())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64, 128, 24])  # per-key table reads (16, 24), one per tile (64, 128)
@pytest.mark.parametrize("group", [1, 4])
def test_paged_reads_equal_staged_reads(at, dtype, block_size, group):
    """The block-table reads of the engine's pool give the staged path's bits, and the same pool."""
    from megatron_iso.inference.kv_blocks import PagedKVCache
    from megatron_iso.ops.attention.kv_cache import KVStepPlan

    hkv = HQ // group
    cache = PagedKVCache([0], 64, block_size, hkv, D, dtype=dtype, device="cuda", prefix_caching=False)
    cache._free = torch.randperm(64, generator=torch.Generator().manual_seed(block_size)).tolist()  # shuffled blocks
    for pool in (cache.k[0], cache.v[0]):
        pool.fill_(float("nan"))  # rows nobody wrote must never reach a product
    ids = [0, 1, 2, 3]
    for s in ids:
        cache.admit(s, [], 0)
    lens = [0, 0, 0, 0]
    steps = ([5, 200, 1, 77], [64, 3, 130, 1], *([[1, 1, 1, 1]] * 20))  # prefill, chunk, decode
    for i, counts in enumerate(steps):
        starts = list(lens)
        for s, a, c in zip(ids, starts, counts, strict=True):
            cache.prepare_append(s, a, c)
        cu = [0, *torch.tensor(counts).cumsum(0).tolist()]
        q, k, v, gate = _qkvg(cu[-1], dtype, 100 + i, HQ, hkv)
        args = (torch.tensor(starts, device="cuda"), torch.tensor(cu, device="cuda"))  # the paged kernel reads them
        kw = {"slots": torch.arange(4), "gate": gate}
        before = (cache.k[0].clone(), cache.v[0].clone())
        view = cache.step_view(ids, starts, counts)
        kc, vc = view.layer(0)
        staged = at.attention_with_kv_cache(q, k, v, kc, vc, *args, plan=KVStepPlan(cu, starts, [0, 1, 2, 3]), **kw)
        view.finish()
        after = (cache.k[0].clone(), cache.v[0].clone())
        cache.k[0].copy_(before[0])
        cache.v[0].copy_(before[1])
        view = cache.step_view(ids, starts, counts)
        paged = at.attention_with_paged_kv_cache(
            q, k, v, view.paged_layer(0), *args, plan=KVStepPlan(cu, starts, [0, 1, 2, 3]), **kw
        )
        assert torch.isfinite(paged.float()).all(), counts
        assert _same(paged, staged), (i, counts)
        assert _same(cache.k[0], after[0]) and _same(cache.v[0], after[1]), (i, counts)
        lens = [a + c for a, c in zip(starts, counts, strict=True)]


def test_paged_dispatch_on_cuda(at):
    from megatron_iso.ops import attention

    q = torch.zeros(1, HQ, D, device="cuda")
    assert attention.paged_kv_reads(q, "correctness") and not attention.paged_kv_reads(q, "performance")
    assert not attention.paged_kv_reads(q.cpu(), "correctness")


# Tile configs the kernel must give the same bits under: the shipped ones and others that change the
# MMA instruction (mma for 16/32 rows, wgmma from 64), the warps per tile and the pipeline depth
# (64 x 8 warps: the training tile tools/bench_ops.py times beside the shipped one), and parked ones (the
# one launch's running accumulator in fp32 scratch between segment merges, also timed there).
_TILES = [(128, 8, 3), (64, 8, 3), (64, 4, 3), (32, 4, 3), (16, 4, 3), (16, 2, 3)]
_PARKED_TILES = [(64, 4, 3), (64, 4, 2), (64, 8, 2), (16, 4, 3)]


def _max_stages(dtype: torch.dtype, d: int) -> int:
    """Pipeline depth whose k/v buffers fit in an H200's 227 KB of shared memory per block."""
    kv_bytes = 2 * 64 * d * (4 if dtype == torch.float32 else 2)  # one stage: a 64-key k and v block
    return max(1, min(3, (160 * 1024) // kv_bytes))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "d"), [(1, 128), (2, 128), (4, 128), (8, 64), (4, 256)])
def test_tile_config_moves_no_bit(at, launch, dtype, group, d):
    """The whole forward (every row of a pack) and a decode step are the same bits under every tile
    config: the kernel's row sum is a fixed tree and its dots accumulate per element in the tensor
    core's K steps, so decode may run 16-row tiles while training runs 64-row ones. A register cap (ptxas's
    allocation, no other instruction) too, and a parked config (the running accumulator stored to fp32
    scratch and read back at each merge): the lengths reach 200 keys, two segments, so a tile parks and
    reads back across the barrier."""
    hkv = 2
    lens = [1, 37, 64, 200]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    q, k, v, _ = _qkvg(cu[-1], dtype, 7 + group + d, hq=hkv * group, hkv=hkv, d=d)
    tiles = [
        launch.AttentionTileConfig(m, w, min(s, _max_stages(dtype, d)), park=park)
        for shapes, park in ((_TILES, False), (_PARKED_TILES, True))
        for m, w, s in shapes
        if m * d * dtype.itemsize <= 32768
    ]
    tiles.append(launch.AttentionTileConfig(16, 4, min(2, _max_stages(dtype, d)), maxnreg=128))  # a register cap
    shipped = at.attention_varlen(q, k, v, torch.tensor(cu))
    for tile in tiles:
        assert _same(at.attention_varlen(q, k, v, torch.tensor(cu), config=tile), shipped), tile
    last = [b - 1 for b in cu[1:]]
    dec_q = q[last].contiguous()
    for tile in [None, *tiles]:
        for split in (None, False, True):
            call, out = launch.prepare(
                dec_q, k, v, None, list(range(len(lens) + 1)), [n - 1 for n in lens], cu[:-1], d**-0.5, 64, tile,
                split=split,
            )  # fmt: skip
            call()
            assert _same(out, shipped[last]), (tile, split)


# Qwen3-0.6B attention: 16 query heads, 8 kv heads, head dim 128 (batch-1 decode: 8 programs unsplit).
QWEN3_06B = (16, 8, 128)
# Both sides of the 64-key blocks and of the 128-key segments (SEG_BLOCKS = 2), and a few segments long.
SEG_LENS = [1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 640]


def _paged_layer(k, v, cu, lens, slots, page, width):
    """Each sequence's keys but its last in a paged pool of shuffled blocks (slot ``slots[i]``'s table row),
    NaN elsewhere; write rows for each sequence's last key."""
    from megatron_iso.ops.attention.kv_cache import PagedKVLayer

    n, hkv, d = len(lens), k.shape[1], k.shape[2]
    blocks = width * n + 1
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(page))[: width * n].view(n, width)
    table = table.to("cuda").contiguous()
    kp = torch.full((blocks, page, hkv, d), float("nan"), device="cuda", dtype=k.dtype)
    vp = kp.clone()
    write = []
    for i, (a, m) in enumerate(zip(cu, lens, strict=False)):
        j = torch.arange(m, device="cuda")
        rows = table[slots[i]][j // page] * page + j % page
        kp.view(-1, hkv, d)[rows[:-1]] = k[a : a + m - 1]
        vp.view(-1, hkv, d)[rows[:-1]] = v[a : a + m - 1]
        write.append(rows[-1])
    return PagedKVLayer(kp, vp, table, torch.stack(write))


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_decode_equals_unsplit_and_varlen(at, launch, dtype):
    """A decode step split over key segments (forced, and the auto schedule) == the one-launch step == the
    training forward at each sequence's last position, at Qwen3-0.6B heads: a batch mixing the lengths, each
    sequence alone (batch 1: the auto schedule splits), from a contiguous cache and from paged pools with
    real and placeholder host starts; the forced split of the training forward itself too. The parked one
    launch (running accumulator in fp32 scratch between merges) as well: the training forward in 64-row tiles
    (up to 5 segments: 4 parks) and the paged decode step in 16-row ones."""
    from megatron_iso.ops.attention.kv_cache import KVStepPlan

    hq, hkv, d = QWEN3_06B
    lens, n = SEG_LENS, len(SEG_LENS)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    q, k, v, gate = _qkvg(cu[-1], dtype, 21, hq, hkv, d)
    train = at.attention_varlen(q, k, v, torch.tensor(cu), gate=gate, split=False)
    for progs in (None, 3):  # prefill tiles: rows of one tile end in different segments
        call, split_train = launch.prepare(q, k, v, gate, cu, [0] * n, cu[:-1], 1 / math.sqrt(d), 64, None,
                                           split=True, segment_programs=progs)  # fmt: skip
        call()
        assert _same(split_train, train), progs
    stages = 2 if dtype == torch.float32 else 3
    parked = at.attention_varlen(
        q, k, v, torch.tensor(cu), gate=gate, config=launch.AttentionTileConfig(64, 4, stages, park=True)
    )
    assert _same(parked, train), "parked training forward"
    parked_decode = launch.AttentionTileConfig(16, 4, stages, park=True)
    last = [c - 1 for c in cu[1:]]
    want = train[last]
    sq, sk, sv, sg = (t[last].contiguous() for t in (q, k, v, gate))
    starts = [m - 1 for m in lens]
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    kc, vc = _cache(n, max(lens) + 64, dtype, hkv, d)
    for i, (a, m) in enumerate(zip(cu, lens, strict=False)):
        kc[slots[i], : m - 1] = k[a : a + m - 1]
        vc[slots[i], : m - 1] = v[a : a + m - 1]
    for split in (False, True, None):
        got = at.attention_with_kv_cache(
            sq, sk, sv, kc, vc, torch.tensor(starts), torch.arange(n + 1), slots=torch.tensor(slots), gate=sg,
            split=split,
        )  # fmt: skip
        assert _same(got, want), split
        for i in range(n):
            one = slice(i, i + 1)
            got = at.attention_with_kv_cache(
                sq[one], sk[one], sv[one], kc, vc, torch.tensor(starts[one]), torch.tensor([0, 1]),
                slots=torch.tensor(slots[one]), gate=sg[one], split=split,
            )  # fmt: skip
            assert _same(got, want[one]), (split, lens[i])
    meta = (torch.tensor(starts, device="cuda"), torch.arange(n + 1, device="cuda"))
    for page in (16, 64):
        layer = _paged_layer(k, v, cu, lens, slots, page, -(-(max(lens) + 200) // page))
        for split, config in ((False, None), (True, None), (None, None), (False, parked_decode)):
            for placeholder in (False, True):  # placeholder: a captured step's plan, positions on the device only
                plan = KVStepPlan(list(range(n + 1)), [0] * n if placeholder else starts, slots, placeholder)
                got = at.attention_with_paged_kv_cache(
                    sq, sk, sv, layer, *meta, slots=torch.tensor(slots), gate=sg, plan=plan, split=split,
                    config=config,
                )  # fmt: skip
                assert torch.isfinite(got.float()).all(), (page, split, config, placeholder)
                assert _same(got, want), (page, split, config, placeholder)


@pytest.mark.parametrize(("split", "park"), [(True, False), (False, False), (False, True)])
def test_split_decode_replays_from_a_cuda_graph(at, launch, split, park):
    """A decode step captured once (placeholder host starts, block-table capacity 1024 keys) and replayed with
    new positions written into its device inputs, crossing block and segment boundaries: the training
    forward's bits at every replay, split or not (the split grid is the capacity's, the live segments are
    counted on the device), and parked (its scratch allocated in the capture's pool)."""
    from megatron_iso.ops.attention.kv_cache import KVStepPlan, PagedKVLayer

    config = launch.AttentionTileConfig(16, 4, 3, park=True) if park else None

    hq, hkv, d = QWEN3_06B
    length, n, page, width = 700, 2, 16, 64
    cu = [0, length, 2 * length]
    q, k, v, gate = _qkvg(cu[-1], torch.bfloat16, 31, hq, hkv, d)
    train = at.attention_varlen(q, k, v, torch.tensor(cu), gate=gate)
    full = _paged_layer(k, v, cu, [length + 1] * n, [0, 1], page, width)  # every key of both sequences
    write = torch.zeros(n, dtype=torch.int64, device="cuda")
    layer = PagedKVLayer(full.k_pool, full.v_pool, full.block_tables, write)
    sq, sg = (torch.zeros(n, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sk, sv = (torch.zeros(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    starts_t, cu_t = torch.zeros(n, dtype=torch.int64, device="cuda"), torch.arange(n + 1, device="cuda")
    plan = KVStepPlan(list(range(n + 1)), [0] * n, [0, 1], device_positions=True)

    def step() -> torch.Tensor:
        return at.attention_with_paged_kv_cache(
            sq, sk, sv, layer, starts_t, cu_t, slots=torch.tensor([0, 1]), gate=sg, plan=plan, split=split,
            config=config,
        )  # fmt: skip

    def place(positions: list[int]) -> list[int]:
        rows = [a + p for a, p in zip(cu, positions, strict=False)]
        for dst, src in ((sq, q), (sk, k), (sv, v), (sg, gate)):
            dst.copy_(src[rows])
        starts_t.copy_(torch.tensor(positions))
        tab = full.block_tables
        write.copy_(torch.stack([tab[i, p // page] * page + p % page for i, p in enumerate(positions)]))
        return rows

    place([5, 9])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels and builds the step's tables outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for positions in ([0, 63], [64, 127], [128, 129], [255, 256], [257, 639], [699, 400]):
        rows = place(positions)
        graph.replay()
        torch.cuda.synchronize()
        assert _same(out, train[rows]), positions
