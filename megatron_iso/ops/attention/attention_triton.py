"""Causal attention in Triton: the GPU path of the invariant attention (correctness profile, cuda).

Same signatures as :mod:`megatron_iso.ops.attention.reference`. One arithmetic, two schedules, three cases;
what differs between the cases is only where a sequence's keys are read from:

- training / scoring (:func:`attention_varlen`): the packed k/v tensors, sequence ``i``'s keys start at
  token ``cu_seqlens[i]``;
- prefill and decode (:func:`attention_with_kv_cache`): k/v are first written into the cache, then the
  kernel reads every key from cache row ``slots[i]`` (or through a paged pool's block table,
  :func:`attention_with_paged_kv_cache`).

The arithmetic (the numerical policy) and the kernels are in
:mod:`megatron_iso.ops.attention.forward_kernels_triton`; the tile configs, tile tables, the schedule and
the launch (``prepare``) in :mod:`megatron_iso.ops.attention.forward_launch_triton`. This module checks the
inputs, writes the cache and registers both implementations in the contract.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import triton
import triton.language as tl

from megatron_iso.ops.attention.forward_launch_triton import (
    CONFIGS,
    DECODE_CONFIGS,
    SEG_BLOCKS,
    WIDE_CONFIGS,
    WIDE_DECODE_CONFIGS,
    WIDE_HEAD_DIM,
    AttentionTileConfig,
    _tables,
    prepare,
)
from megatron_iso.ops.attention.kv_cache import KVStepPlan, PagedKVLayer, resolve_plan
from megatron_iso.ops.attention.reference import (
    DEFAULT_KV_BLOCK,
    _bounds,
    _check_block,
    _check_qkv,
    _scale,
)
from megatron_iso.registry import OpImpl, Profile, register

IMPL_ID = "attention.triton"
KVCACHE_IMPL_ID = "attention_kvcache.triton"
VERSION = "3"  # 2: the block row sum is a fixed tree (the tile config became a schedule choice); 3: key segments


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
    config: AttentionTileConfig | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences (training / scoring); see ``reference.attention_varlen``.

    ``config`` and ``split`` (:func:`prepare`) are for tests and benchmarks; the correctness profile uses
    :data:`CONFIGS` and one launch (only a decode step splits on its own).
    """
    _check_qkv(q, k, v, gate)
    _check_block(kv_block)
    cu = _bounds(cu_seqlens)
    if cu[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but q has {q.shape[0]} tokens")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    n = len(cu) - 1
    scale = _scale(softmax_scale, q.shape[-1])
    call, out = prepare(q, k, v, gate, cu, [0] * n, cu[:-1], scale, kv_block, config, split=split)
    call()
    return out


def write_index(
    cu: list[int], starts: list[int], slot_ids: list[int], max_len: int, device: torch.device
) -> torch.Tensor:
    """Row of every new token in the flattened ``[slots * max_len]`` cache (int64, on ``device``)."""
    lens = torch.tensor([b - a for a, b in pairwise(cu)], dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    first = torch.cumsum(lens, 0) - lens
    base = torch.tensor(starts, dtype=torch.int64) + torch.tensor(slot_ids, dtype=torch.int64) * max_len
    dst = base[seq] + torch.arange(int(lens.sum())) - first[seq]
    return dst.to(device, non_blocking=True)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, dst_ptr, H, D, SK_T, SK_H, SV_T, SV_H, BLOCK: tl.constexpr
):  # fmt: skip
    """Token ``t``'s k and v rows (``[H, D]`` at their own strides: views of the QKV projection) copied to cache row
    ``dst[t]`` of both stores, BLOCK elements per program."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = e < H * D
    h, d = e // D, e % D
    row = tl.load(dst_ptr + t).to(tl.int64) * (H * D)
    tl.store(kc_ptr + row + e, tl.load(k_ptr + t * SK_T + h * SK_H + d, mask=m), mask=m)
    tl.store(vc_ptr + row + e, tl.load(v_ptr + t * SV_T + h * SV_H + d, mask=m), mask=m)


_WRITE_KV_BLOCK = 1024


def write_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu: list[int],
    starts: list[int],
    slot_ids: list[int],
    dst: torch.Tensor | None = None,
) -> None:
    """Append each sequence's new k/v at ``starts[i]..`` of cache row ``slot_ids[i]`` (exact copies): one launch for
    both stores, reading k and v where they lie.

    ``dst``: :func:`write_index` of these lists, if the caller already has it."""
    if dst is None:
        dst = write_index(cu, starts, slot_ids, k_cache.shape[1], k.device)
    t, h, d = k.shape
    if not t:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kv_kernel[(t, triton.cdiv(h * d, _WRITE_KV_BLOCK))](
        k, v, k_cache, v_cache, dst, h, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1), BLOCK=_WRITE_KV_BLOCK
    )  # fmt: skip


def _check_kv_store(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, what: str, rows: str) -> None:
    """A contiguous ``[rows..., Hkv, D]`` k/v store (slot cache or paged pool) in k/v's dtype."""
    if kc.dtype != k.dtype or vc.dtype != v.dtype:
        raise TypeError(f"{what} dtype {kc.dtype}/{vc.dtype} must equal k/v dtype {k.dtype}")
    if kc.dim() != 4 or kc.shape[2:] != k.shape[1:] or vc.shape != kc.shape:
        raise ValueError(f"{what} must be [{rows}, {k.shape[1]}, {k.shape[2]}], got {tuple(kc.shape)}")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError(f"attention_triton: the {what} must be contiguous")


def attention_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
    config: AttentionTileConfig | None = None,
    plan: KVStepPlan | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """Prefill (any chunk) and decode: write k/v into the cache, then attend from the cache with the
    kernel of :func:`attention_varlen`; see ``reference.attention_with_kv_cache``.

    With a ``plan`` (the step's layout as host lists) nothing is read back from the device, and the
    write indices and tile tables are built by the step's first layer and reused by the others.
    ``split``: the schedule (:func:`prepare`; None = :func:`split_schedule`), for tests and benchmarks."""
    _check_qkv(q, k, v, gate)
    _check_block(kv_block)
    _check_kv_store(k, v, k_cache, v_cache, "kv cache", "slots, max_len")
    plan = resolve_plan(plan, q, cu_seqlens_q, cache_seqlens, slots)
    cu, starts, slot_ids = plan.cu, plan.starts, plan.slots
    max_len, dev = k_cache.shape[1], q.device

    def fits() -> bool:
        for i, ((a, b), s, slot) in enumerate(zip(pairwise(cu), starts, slot_ids, strict=True)):
            if s + (b - a) > max_len:
                raise ValueError(
                    f"sequence {i} (slot {slot}) needs {s + b - a} cache positions, cache max_len is {max_len}"
                )
        return True

    plan.memo(("fits", max_len), fits)
    q = q if q.stride(-1) == 1 else q.contiguous()
    dst = plan.memo(("write_index", max_len, dev), lambda: write_index(cu, starts, slot_ids, max_len, dev))
    write_cache(k, v, k_cache, v_cache, cu, starts, slot_ids, dst=dst)
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kv_offsets = [s * max_len for s in slot_ids]

    def tables(group: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = ("triton_tables", group, block_m, max_len, dev)
        return plan.memo(key, lambda: _tables(cu, starts, kv_offsets, group, block_m, dev))

    scale = _scale(softmax_scale, q.shape[-1])
    call, out = prepare(
        q, kc, vc, gate, cu, starts, kv_offsets, scale, kv_block, config, tables, kv_capacity=max_len, split=split
    )
    call()
    return out


def attention_with_paged_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    paged: PagedKVLayer,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
    config: AttentionTileConfig | None = None,
    plan: KVStepPlan | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """:func:`attention_with_kv_cache` on a paged pool: k/v are written straight into their pool rows
    (``paged.write_idx``) and the kernel reads keys through the block table (row ``slots[i]`` for
    sequence i), so nothing is staged or written back. Same kernel, tiles, kv block order (aligned at
    key 0) and masking as the contiguous cache: only addresses differ, so the output bits are those of
    attending from a staged copy of the same blocks. Any block size works: a block that is a multiple
    of ``kv_block`` costs one table read per kv tile, any other one a read per key. The split schedule's
    segment axis is sized by the table's capacity (width x block size), never by the step's positions,
    which a captured decode graph holds on the device only."""
    _check_qkv(q, k, v, gate)
    _check_block(kv_block)
    kp, vp, bt = paged.k_pool, paged.v_pool, paged.block_tables
    _check_kv_store(k, v, kp, vp, "paged kv pool", "blocks, block_size")
    if bt.dim() != 2 or bt.dtype not in (torch.int32, torch.int64) or not bt.is_contiguous() or bt.device != q.device:
        raise ValueError(
            f"block_tables must be a contiguous [rows, width] int32/int64 tensor on {q.device}, "
            f"got {tuple(bt.shape)} {bt.dtype} on {bt.device}"
        )
    if paged.write_idx.shape != (q.shape[0],) or paged.write_idx.dtype != torch.int64:
        raise ValueError(
            f"write_idx must be int64 [{q.shape[0]}] (one pool row per new token), got "
            f"{tuple(paged.write_idx.shape)} {paged.write_idx.dtype}"
        )
    plan = resolve_plan(plan, q, cu_seqlens_q, cache_seqlens, slots, reads_device_positions=True)
    cu, starts, slot_ids = plan.cu, plan.starts, plan.slots
    for name, t, size in (("cu_seqlens_q", cu_seqlens_q, len(cu)), ("cache_seqlens", cache_seqlens, len(starts))):
        # The kernel reads these two on the device (not the plan's host copy): see ``prepare``'s seq_meta.
        if t.shape != (size,) or t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
            raise ValueError(
                f"{name} must be an int32/int64 [{size}] tensor on {q.device}, got {tuple(t.shape)} {t.dtype} "
                f"on {t.device}"
            )
    page, rows, width, dev = paged.block_size, bt.shape[0], bt.shape[1], q.device

    def fits() -> bool:
        for i, ((a, b), s, slot) in enumerate(zip(pairwise(cu), starts, slot_ids, strict=True)):
            if not 0 <= slot < rows:
                raise ValueError(f"sequence {i}: slot {slot} is not a block-table row (block_tables has {rows})")
            if -(-(s + b - a) // page) > width:
                raise ValueError(
                    f"sequence {i} (slot {slot}) needs {s + b - a} positions, block_tables holds "
                    f"{width} blocks of {page}"
                )
        return True

    plan.memo(("paged_fits", page, rows, width), fits)
    q = q if q.stride(-1) == 1 else q.contiguous()
    write_cache(k, v, kp, vp, cu, starts, slot_ids, dst=paged.write_idx)
    kv_offsets = [s * width for s in slot_ids]  # element offset of each sequence's table row

    def tables(group: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = ("triton_paged_tables", group, block_m, width, dev)
        return plan.memo(key, lambda: _tables(cu, starts, kv_offsets, group, block_m, dev))

    call, out = prepare(
        q,
        kp.view(-1, *kp.shape[2:]),
        vp.view(-1, *vp.shape[2:]),
        gate,
        cu,
        starts,
        kv_offsets,
        _scale(softmax_scale, q.shape[-1]),
        kv_block,
        config,
        tables,
        block_tables=bt,
        page=page,
        seq_meta=(cu_seqlens_q, cache_seqlens),
        kv_capacity=width * page,
        split=split,
    )
    call()
    return out


def _probe_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4004)
    q = torch.randn(76, 4, 64, generator=g)
    k = torch.randn(76, 2, 64, generator=g)
    v = torch.randn(76, 2, 64, generator=g)
    gate = torch.randn(76, 4, 64, generator=g)
    return tuple(t.cuda() for t in (q, k, v, gate))


def _probe() -> dict[str, torch.Tensor]:
    q, k, v, gate = _probe_inputs()
    cu = torch.tensor([0, 1, 6, 76])
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[f"varlen_{name}"] = attention_varlen(q.to(dt), k.to(dt), v.to(dt), cu).cpu()
        out[f"varlen_gated_{name}"] = attention_varlen(q.to(dt), k.to(dt), v.to(dt), cu, gate=gate.to(dt)).cpu()
    return out


def _probe_kvcache() -> dict[str, torch.Tensor]:
    q, k, v, _ = (t[:70] for t in _probe_inputs())
    kc = torch.zeros(1, 80, 2, 64, device="cuda")
    vc = torch.zeros_like(kc)
    pre = attention_with_kv_cache(q[:69], k[:69], v[:69], kc, vc, torch.tensor([0]), torch.tensor([0, 69]))
    dec = attention_with_kv_cache(q[69:], k[69:], v[69:], kc, vc, torch.tensor([69]), torch.tensor([0, 1]))
    return {"prefill_fp32": pre.cpu(), "decode_fp32": dec.cpu()}


def _constants() -> dict[str, object]:
    c: dict[str, object] = {
        "kv_block": DEFAULT_KV_BLOCK,
        "kv_block_alignment": "key position 0 of the sequence",
        "segment_blocks": SEG_BLOCKS,
        "segment_alignment": "key position 0 of the sequence (segment s: kv blocks [s, s + 1) * segment_blocks)",
        "block_order": "per segment from m=-inf, l=0, acc=0: ascending blocks, online softmax (m in log2 domain, "
        "l, acc in fp32); unseen block: state kept",
        "segment_merge": "ascending; segment 0 taken as the state; M'=max(M,m), a=exp2(M-M'), c=exp2(m-M'), "
        "L'=fma(L,a,l*c), ACC'=fma(ACC,a,acc*c); unseen segment: state kept",
        "score": "tl.dot(q, k^T) fp32 accumulate (fp32 inputs: ieee), * (scale * log2 e)",
        "exp": "tl.exp2 (fp32)",
        "row_sum": "fixed pairwise tree over the kv block's columns (adjacent pairs first); l=fma(l,alpha,sum)",
        "pv": "tl.dot(p rounded to the input dtype (fp32: ieee), v) accumulated into acc * alpha",
        "masked": "score -inf, p = +0, keys >= kv_len loaded as 0",
        "output": "div_rn(ACC, L) * div_rn(1, 1 + exp(-gate)) if gated, rounded once",
        "accumulate_dtype": "fp32",
        "tile_rows": "(token, query head of the kv group) pairs of one sequence and kv head",
        "triton": triton.__version__,
    }
    tables = (("tile", CONFIGS), ("decode_tile", DECODE_CONFIGS))
    wide_tables = (("tile", WIDE_CONFIGS), ("decode_tile", WIDE_DECODE_CONFIGS))
    for dt in CONFIGS:
        name = str(dt).removeprefix("torch.")
        for label, table in tables:
            c[f"{name}_{label}"] = _tile_record(table[dt])
        for label, table in wide_tables:
            c[f"{name}_{label}_head_dim_gt_{WIDE_HEAD_DIM}"] = _tile_record(table[dt])
    return c


def _tile_record(cfg: AttentionTileConfig) -> list[object]:
    """A table's tile config as the contract records it: [rows, warps, stages], then "park" for a parked one and
    "maxnreg=N" for a register cap.

    ``park`` and ``maxnreg`` are schedule choices like warps and stages (the same operations on the same floats),
    so they join the tile's record and nothing else (no numerical-policy entry of their own): a table that switches
    to a parked or capped tile is a new schedule on record, as a change of warps is. Recorded only when set, so the
    other tables' records, and the digests, are those from before the fields existed."""
    extra = (["park"] if cfg.park else []) + ([f"maxnreg={cfg.maxnreg}"] if cfg.maxnreg is not None else [])
    return [cfg.block_m, cfg.num_warps, cfg.num_stages, *extra]


_NOTE = (
    f"prefill/decode write k/v into the cache, then run the kernels of attention.triton@{VERSION} reading keys "
    "from the cache instead of the packed tensors: same blocks, segments, row-sum tree, segment merge and per-row "
    "arithmetic (decode in 16-row tiles, and split over key segments when it leaves SMs idle: the segments' states "
    "merged by the same helper across programs; neither moves a bit), so prefill + decode == trainer_forward bit "
    "for bit (tests/gpu/test_attention_triton.py)"
)
register(
    OpImpl(
        op="attention",
        impl_id=IMPL_ID,
        version=VERSION,
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=attention_varlen,
        constants=_constants(),
        cases=("trainer_forward", "trainer_score"),
        probe=_probe,
    )
)
register(
    OpImpl(
        op="attention_kvcache",
        impl_id=KVCACHE_IMPL_ID,
        version=VERSION,
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=attention_with_kv_cache,
        constants={**_constants(), "cache_write": "before attention, exact copies of k and v; cache dtype == k dtype"},
        cases=("prefill", "decode"),
        equivalence_note=_NOTE,
        probe=_probe_kvcache,
    )
)
__all__ = [
    "attention_varlen",
    "attention_with_kv_cache",
    "attention_with_paged_kv_cache",
    "write_cache",
    "write_index",
]
