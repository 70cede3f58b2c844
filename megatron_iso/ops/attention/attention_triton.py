"""Causal attention in Triton: the GPU path of the invariant attention (correctness profile, cuda).

Same signatures as :mod:`megatron_iso.ops.attention.reference`. One arithmetic, two schedules, three cases;
what differs between the cases is only where a sequence's keys are read from:

- training / scoring (:func:`attention_varlen`): the packed k/v tensors, sequence ``i``'s keys start at
  token ``cu_seqlens[i]``;
- prefill and decode (:func:`attention_with_kv_cache`): k/v are first written into the cache, then the
  kernel reads every key from cache row ``slots[i]`` (or through a paged pool's block table,
  :func:`attention_with_paged_kv_cache`).

Per query position ``p`` the arithmetic is fixed (the GPU numerical policy, its own digest):
- keys in blocks of ``kv_block`` (64) positions aligned at key 0; blocks in segments of :data:`SEG_BLOCKS`
  consecutive blocks (segment ``s``: blocks ``[s * SEG_BLOCKS, (s + 1) * SEG_BLOCKS)``, also aligned at key 0,
  so the segmentation depends on key positions alone);
- inside a segment, from a fresh state (``m = -inf``, ``l = 0``, ``acc = 0``), the blocks in ascending order
  by online softmax in fp32 (running max ``m`` in the log2 domain, sum ``l``, accumulator ``acc``);
- scores ``dot(q, k^T)`` (fp32 accumulate; fp32 inputs use the exact ``ieee`` dot, never tf32), times
  ``scale * log2(e)``; masked keys (``j > p``, ``j >= kv_len``) get ``-inf`` and probability exactly +0;
  keys at or past ``kv_len`` are loaded as 0, so stale or garbage cache contents never reach a product;
- a block in which a row sees no key leaves that row's state untouched (a select, not ``acc * 1 + 0``);
- the block's row sum of P by one fixed pairwise tree over its ``kv_block`` columns
  (``ops.common.tree_triton.fixed_tree_rowsum``), never ``tl.sum``, whose order follows the register layout;
  ``l = fma(l, alpha, rowsum)``;
- ``P.V`` with P rounded to the input dtype for bf16/fp16 (fp32 stays fp32), accumulated in fp32;
- segments merge in ascending order into the running ``(M, L, ACC)`` (:func:`_merge_segment`): segment 0 is
  taken as the state; then ``M' = max(M, m)``, ``a = exp2(M - M')``, ``c = exp2(m - M')``,
  ``L' = fma(L, a, l * c)``, ``ACC' = fma(ACC, a, acc * c)``, explicit fmas; a row that sees no key of a
  segment keeps its state (a select);
- output ``div_rn(ACC, L)``, times ``sigmoid(gate)`` if gated, rounded once to the input dtype.

Schedules (:func:`prepare`, :func:`split_schedule`), which move no bit:
- one launch (:func:`_attend_kernel`): a program walks all key blocks of its tile and merges each segment as
  it ends (training, prefill, and decode steps that fill the machine);
- split over keys (flash-decoding; :func:`_segments_kernel` then :func:`_combine_kernel`): for a decode step
  with fewer programs (tiles x kv heads) than SMs, segment programs compute segments' ``(m, l, acc)`` into fp32
  scratch (exact copies) and a combine program per tile merges them in ascending order with the same helper.
  The segment axis is sized by the static key capacity (the cache's length, the block table's width x block
  size), never by the step's positions: a captured decode graph replays one grid; segments past a tile's last
  position run nothing, and the combine reads only those up to it, counted on the device.

A program owns BLOCK_M rows of one sequence and one kv head; rows are (token, query head of the kv
group) pairs, so GQA groups share each loaded key block. Every step of a row's arithmetic is set by
the row alone: the max (exact), exp2 (elementwise), the row-sum tree, the merge (elementwise) and the two
dots, whose elements accumulate over K in the tensor core's steps of 16 whether the tile runs mma (16- and
32-row tiles) or wgmma (64 rows and more) on sm_90. So the tile config (rows, warps, stages) is a
schedule choice, like which rows share a tile: training and prefill run 64-row tiles, a decode step
(one new token per sequence) 16-row tiles (:data:`DECODE_CONFIGS`), which read the KV cache at
several times the bandwidth of a 128-row tile holding 2-8 live rows. tests/gpu/test_attention_triton.py
holds every config and both schedules to the same bits; the configs stay in the contract's constants (both
sides run them) because that equality is the hardware's, measured, not a property of the code alone.

Signed zeros: in the diagonal block a training forward multiplies masked (p = +0) probabilities with
the real values of later tokens, a decode step with 0 (keys past ``kv_len``); the products are +-0 and
change no sum unless every visible product of an output element is -0 (which needs -0 values in v).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import triton
import triton.language as tl

from megatron_iso.contract.registry import OpImpl, Profile, register
from megatron_iso.ops.attention.kv_cache import KVStepPlan, PagedKVLayer, resolve_plan
from megatron_iso.ops.attention.reference import (
    DEFAULT_KV_BLOCK,
    _bounds,
    _check_block,
    _check_qkv,
    _scale,
)
from megatron_iso.ops.common.sm_count import sm_count
from megatron_iso.ops.common.tree_triton import fixed_tree_rowsum

IMPL_ID = "attention.triton"
KVCACHE_IMPL_ID = "attention_kvcache.triton"
VERSION = "3"  # 2: the block row sum is a fixed tree (the tile config became a schedule choice); 3: key segments
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionTileConfig:
    """Everything that fixes a row's instruction sequence besides kv_block (keyed into the contract)."""

    block_m: int  # rows (token x group head) per program
    num_warps: int
    num_stages: int


# Per input dtype and head width, and whether the launch is a decode step (one new token per sequence):
# never chosen from the batch size. The tile config moves no bit (module docstring), so decode takes
# 16-row tiles (a GQA group's 2-8 live rows, not 128 of which 2 are live) and many more programs.
CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=64, num_warps=4, num_stages=3),
    torch.float16: AttentionTileConfig(block_m=64, num_warps=4, num_stages=3),
    torch.float32: AttentionTileConfig(block_m=64, num_warps=4, num_stages=2),
}
DECODE_CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=3),
    torch.float16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=3),
    torch.float32: AttentionTileConfig(block_m=16, num_warps=4, num_stages=2),
}
# Heads wider than 128 (Qwen3.5 / Qwen3-Next attention: 256). The tiles above need 256 KB of shared
# memory at head dim 256 (an H200 has 227 KB per block), so fewer rows and stages.
WIDE_HEAD_DIM = 128
MAX_HEAD_DIM = 256
WIDE_CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=64, num_warps=8, num_stages=2),
    torch.float16: AttentionTileConfig(block_m=64, num_warps=8, num_stages=2),
    torch.float32: AttentionTileConfig(block_m=32, num_warps=4, num_stages=1),
}
WIDE_DECODE_CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=2),
    torch.float16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=2),
    torch.float32: AttentionTileConfig(block_m=16, num_warps=4, num_stages=1),
}
INTERPRET_CONFIG = AttentionTileConfig(block_m=16, num_warps=4, num_stages=1)
# Key blocks per segment: softmax state restarts at each segment and segments merge in ascending order
# (module docstring). Part of the arithmetic (contract constants), so training and decode use the same.
SEG_BLOCKS = 2
# The auto schedule splits only while the fp32 scratch (rows x capacity segments x (head dim + 2)) stays below
# this: e.g. 16 rows of Qwen3-0.6B at a 32k-key capacity take 34 MB, 32 rows of Qwen3-30B-A3B 136 MB.
SPLIT_SCRATCH_BYTES = 64 << 20
MAX_KV_BLOCK = 512  # the widest key block the kernel is tuned and tested for (the row-sum tree allows 1024)


@triton.jit
def _tile_rows(
    tile, hkv, tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The program's tile: BLOCK_M rows (token, query head of kv head ``hkv``'s group) of one sequence."""
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    tok0 = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - tok0
    start = tl.load(start_ptr + seq)  # position of the sequence's first new token
    # PAGE == 0: token row of key 0 in k_ptr/v_ptr. PAGE > 0 (paged pool of PAGE-token blocks):
    # offset of the sequence's block-table row in bt_ptr; key j lives in pool row
    # bt[j // PAGE] * PAGE + j % PAGE. Only addresses differ: the same key values, tiles and order.
    kv_off = tl.load(kv_off_ptr + seq).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = hkv * GROUP + rows % GROUP
    row_ok = tok < n
    last_pos = start + tl.minimum((row0 + BLOCK_M - 1) // GROUP, n - 1)  # the tile's last query position
    return tok0, start + n, kv_off, tok, head, row_ok, start + tok, last_pos


@triton.jit
def _load_q(q_ptr, tok0, tok, head, row_ok, d, d_ok, stride_qt, stride_qh, CAST_F32: tl.constexpr):
    q_off = (tok0 + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if CAST_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _fresh_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(m, l, acc) before a segment's first key: m = -inf, l = 0, acc = 0."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    return m, tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, BLOCK_D), tl.float32)


@triton.jit
def _block_step(
    q, m, l_sum, acc, b, kv_base_k, kv_base_v, bt_ptr, kv_off, kv_len, pos, row_ok, d, d_ok, stride_kt, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_LOWP: tl.constexpr, IEEE: tl.constexpr,
    CAST_F32: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """Key block ``b`` into a segment's online-softmax state (m, l, acc)."""
    j = b * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < kv_len
    if PAGE == 0:
        kv_row = j.to(tl.int64)
    elif PAGE % BLOCK_N == 0:  # the tile lies in one pool block: one table read
        blk = tl.load(bt_ptr + kv_off + (b * BLOCK_N) // PAGE).to(tl.int64)
        kv_row = blk * PAGE + (b * BLOCK_N) % PAGE + tl.arange(0, BLOCK_N)
    else:  # the tile may straddle pool blocks: a table read per key (keys past kv_len read entry 0)
        blk = tl.load(bt_ptr + kv_off + j // PAGE, mask=j_ok, other=0).to(tl.int64)
        kv_row = blk * PAGE + j % PAGE
    kv_idx = kv_row[:, None] * stride_kt + d[None, :]
    kv_mask = j_ok[:, None] & d_ok[None, :]
    kb = tl.load(kv_base_k + kv_idx, mask=kv_mask, other=0.0)
    vb = tl.load(kv_base_v + kv_idx, mask=kv_mask, other=0.0)
    if CAST_F32:
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    s = tl.dot(q, tl.trans(kb), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(kb))
    s = s * qk_scale
    visible = (j[None, :] <= pos[:, None]) & j_ok[None, :] & row_ok[:, None]
    s = tl.where(visible, s, float("-inf"))
    seen = row_ok & (b * BLOCK_N <= pos)  # the row sees at least key b*BLOCK_N of this block
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.where(seen, tl.exp2(m - m_new), 1.0)
    p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
    l_new = tl.fma(l_sum, alpha, fixed_tree_rowsum(p, BLOCK_M, BLOCK_N))
    acc_new = acc * alpha[:, None]
    if P_LOWP:
        acc_new = tl.dot(p.to(vb.dtype), vb, acc_new)
    elif IEEE:
        acc_new = tl.dot(p, vb, acc_new, input_precision="ieee")
    else:
        acc_new = tl.dot(p, vb, acc_new)
    acc = tl.where(seen[:, None], acc_new, acc)
    l_sum = tl.where(seen, l_new, l_sum)
    m = tl.where(seen, m_new, m)
    return m, l_sum, acc


@triton.jit
def _merge_segment(m_run, l_run, acc_run, m_seg, l_seg, acc_seg, seen, first):
    """Segment state (m_seg, l_seg, acc_seg) into the running state: the ONE merge both schedules run
    (in-program in :func:`_attend_kernel`, across programs in :func:`_combine_kernel`). ``first``
    (segment 0, which every live row sees): the segment's state is taken as it is. A row that sees no
    key of the segment (``seen`` False) keeps its state: a select, never a multiply by 1 and add of 0.
    Explicit fmas, so no compiler contraction choice differs between the two kernels."""
    m_new = tl.maximum(m_run, m_seg)
    a = tl.exp2(m_run - m_new)
    c = tl.exp2(m_seg - m_new)
    l_new = tl.fma(l_run, a, l_seg * c)
    acc_new = tl.fma(acc_run, a[:, None], acc_seg * c[:, None])
    m_out = tl.where(first, m_seg, tl.where(seen, m_new, m_run))
    l_out = tl.where(first, l_seg, tl.where(seen, l_new, l_run))
    acc_out = tl.where(first, acc_seg, tl.where(seen[:, None], acc_new, acc_run))
    return m_out, l_out, acc_out


@triton.jit
def _store_output(
    acc, l_sum, g_ptr, o_ptr, tok0, tok, head, row_ok, d, d_ok, stride_gt, stride_gh, stride_ot, stride_oh,
    GATED: tl.constexpr, GATE_PER_DIM: tl.constexpr,
):  # fmt: skip
    """``div_rn(acc, l)``, times ``sigmoid(gate)`` if gated, rounded once to the output dtype."""
    o = tl.math.div_rn(acc, l_sum[:, None])
    out_mask = row_ok[:, None] & d_ok[None, :]
    if GATED:
        if GATE_PER_DIM:
            g_off = (tok0 + tok).to(tl.int64)[:, None] * stride_gt + head[:, None] * stride_gh + d[None, :]
            gv = tl.load(g_ptr + g_off, mask=out_mask, other=0.0).to(tl.float32)
        else:
            g_off = (tok0 + tok).to(tl.int64) * stride_gt + head * stride_gh
            gv = tl.load(g_ptr + g_off, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        o = o * tl.math.div_rn(1.0, 1.0 + tl.exp(-gv))
    o_off = (tok0 + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _kv_bases(k_ptr, v_ptr, hkv, kv_off, stride_kt, stride_kh, PAGE: tl.constexpr):
    if PAGE > 0:
        return k_ptr + hkv * stride_kh, v_ptr + hkv * stride_kh
    return k_ptr + kv_off * stride_kt + hkv * stride_kh, v_ptr + kv_off * stride_kt + hkv * stride_kh


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, o_ptr,
    tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, bt_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, GATE_PER_DIM: tl.constexpr, P_LOWP: tl.constexpr, IEEE: tl.constexpr,
    CAST_F32: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """One program walks every key block of its tile and merges each segment as it ends (one launch)."""
    tile = tl.program_id(0)
    hkv = tl.program_id(1)
    tok0, kv_len, kv_off, tok, head, row_ok, pos, last_pos = _tile_rows(
        tile, hkv, tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, GROUP, BLOCK_M
    )
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = _load_q(q_ptr, tok0, tok, head, row_ok, d, d_ok, stride_qt, stride_qh, CAST_F32)
    kv_base_k, kv_base_v = _kv_bases(k_ptr, v_ptr, hkv, kv_off, stride_kt, stride_kh, PAGE)
    m_run, l_run, acc_run = _fresh_state(BLOCK_M, BLOCK_D)
    m, l_sum, acc = _fresh_state(BLOCK_M, BLOCK_D)
    n_blocks = last_pos // BLOCK_N + 1
    for b in tl.range(0, n_blocks, num_stages=STAGES):
        m, l_sum, acc = _block_step(
            q, m, l_sum, acc, b, kv_base_k, kv_base_v, bt_ptr, kv_off, kv_len, pos, row_ok, d, d_ok, stride_kt,
            qk_scale, BLOCK_M, BLOCK_N, P_LOWP, IEEE, CAST_F32, PAGE,
        )  # fmt: skip
        if ((b + 1) % SEG_BLOCKS == 0) | (b + 1 == n_blocks):  # the segment ends: merge it, start the next
            seg = b // SEG_BLOCKS
            seen = row_ok & (seg * (SEG_BLOCKS * BLOCK_N) <= pos)
            m_run, l_run, acc_run = _merge_segment(m_run, l_run, acc_run, m, l_sum, acc, seen, seg == 0)
            m, l_sum, acc = _fresh_state(BLOCK_M, BLOCK_D)
    _store_output(
        acc_run, l_run, g_ptr, o_ptr, tok0, tok, head, row_ok, d, d_ok, stride_gt, stride_gh, stride_ot, stride_oh,
        GATED, GATE_PER_DIM,
    )  # fmt: skip


@triton.jit
def _segments_kernel(
    q_ptr, k_ptr, v_ptr, seg_m_ptr, seg_l_ptr, seg_acc_ptr,
    tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, bt_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    qk_scale, HQ, SEG_MAX,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr, STAGES: tl.constexpr,
    P_LOWP: tl.constexpr, IEEE: tl.constexpr, CAST_F32: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """Split schedule, first launch: program (tile, kv head, p) computes segments p, p + P, p + 2P, ... of
    its tile (P = grid size on axis 2), each from a fresh state, and writes each segment's (m, l, acc) to
    fp32 scratch ``[Hq * tokens, SEG_MAX]`` (acc ``[.., D]``). Segments past the tile's last position run
    nothing: the loop bound is read on the device, the grid is static."""
    tile = tl.program_id(0)
    hkv = tl.program_id(1)
    tok0, kv_len, kv_off, tok, head, row_ok, pos, last_pos = _tile_rows(
        tile, hkv, tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, GROUP, BLOCK_M
    )
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = _load_q(q_ptr, tok0, tok, head, row_ok, d, d_ok, stride_qt, stride_qh, CAST_F32)
    kv_base_k, kv_base_v = _kv_bases(k_ptr, v_ptr, hkv, kv_off, stride_kt, stride_kh, PAGE)
    n_blocks = last_pos // BLOCK_N + 1
    n_seg = tl.minimum(last_pos // (SEG_BLOCKS * BLOCK_N) + 1, SEG_MAX)  # never past the scratch
    row_slot = ((tok0 + tok).to(tl.int64) * HQ + head) * SEG_MAX
    for seg in range(tl.program_id(2), n_seg, tl.num_programs(2)):
        m, l_sum, acc = _fresh_state(BLOCK_M, BLOCK_D)
        for b in tl.range(seg * SEG_BLOCKS, tl.minimum(seg * SEG_BLOCKS + SEG_BLOCKS, n_blocks), num_stages=STAGES):
            m, l_sum, acc = _block_step(
                q, m, l_sum, acc, b, kv_base_k, kv_base_v, bt_ptr, kv_off, kv_len, pos, row_ok, d, d_ok, stride_kt,
                qk_scale, BLOCK_M, BLOCK_N, P_LOWP, IEEE, CAST_F32, PAGE,
            )  # fmt: skip
        slot = row_slot + seg
        tl.store(seg_m_ptr + slot, m, mask=row_ok)
        tl.store(seg_l_ptr + slot, l_sum, mask=row_ok)
        tl.store(seg_acc_ptr + slot[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(
    g_ptr, o_ptr, seg_m_ptr, seg_l_ptr, seg_acc_ptr,
    tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr,
    stride_gt, stride_gh, stride_ot, stride_oh, HQ, SEG_MAX,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, GATE_PER_DIM: tl.constexpr,
):  # fmt: skip
    """Split schedule, second launch: per (tile, kv head), the tile's segments in ascending order through
    :func:`_merge_segment`, as :func:`_attend_kernel` merges them in-program; then the same output."""
    tile = tl.program_id(0)
    hkv = tl.program_id(1)
    tok0, _, _, tok, head, row_ok, pos, last_pos = _tile_rows(
        tile, hkv, tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, GROUP, BLOCK_M
    )
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    n_seg = tl.minimum(last_pos // (SEG_BLOCKS * BLOCK_N) + 1, SEG_MAX)  # never past the scratch
    row_slot = ((tok0 + tok).to(tl.int64) * HQ + head) * SEG_MAX
    acc_mask = row_ok[:, None] & d_ok[None, :]
    m_run = tl.load(seg_m_ptr + row_slot, mask=row_ok, other=float("-inf"))
    l_run = tl.load(seg_l_ptr + row_slot, mask=row_ok, other=0.0)
    acc_run = tl.load(seg_acc_ptr + row_slot[:, None] * D + d[None, :], mask=acc_mask, other=0.0)
    for seg in tl.range(1, n_seg, num_stages=STAGES):
        seen = row_ok & (seg * (SEG_BLOCKS * BLOCK_N) <= pos)
        slot = row_slot + seg
        m = tl.load(seg_m_ptr + slot, mask=seen, other=float("-inf"))
        l_sum = tl.load(seg_l_ptr + slot, mask=seen, other=0.0)
        acc = tl.load(seg_acc_ptr + slot[:, None] * D + d[None, :], mask=seen[:, None] & d_ok[None, :], other=0.0)
        m_run, l_run, acc_run = _merge_segment(m_run, l_run, acc_run, m, l_sum, acc, seen, seg == 0)
    _store_output(
        acc_run, l_run, g_ptr, o_ptr, tok0, tok, head, row_ok, d, d_ok, stride_gt, stride_gh, stride_ot, stride_oh,
        GATED, GATE_PER_DIM,
    )  # fmt: skip


def _config(
    dtype: torch.dtype, head_dim: int, config: AttentionTileConfig | None, decode: bool = False
) -> AttentionTileConfig:
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"attention_triton: head dim {head_dim} is not supported (at most {MAX_HEAD_DIM})")
    if config is not None:
        return config
    if _INTERPRET:
        return INTERPRET_CONFIG
    if head_dim > WIDE_HEAD_DIM:
        return (WIDE_DECODE_CONFIGS if decode else WIDE_CONFIGS)[dtype]
    return (DECODE_CONFIGS if decode else CONFIGS)[dtype]


def _plan(lens: list[int], group: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile table (sequence, first row): a schedule, never arithmetic. Later (longer) tiles go first.

    A pure-decode step (one row per sequence) has the table of its batch size: built once per
    (batch, group, block_m, device) and shared by every such step (no host sort, no copy per step;
    a fixed device tensor, as a captured CUDA graph needs). The kernel only reads it.
    """
    if all(n == 1 for n in lens):
        return _decode_plan(len(lens), group, block_m, device)
    return _build_plan(lens, group, block_m, device)


@functools.cache  # never evicted: a captured decode graph reads the table by address (one per batch size)
def _decode_plan(n: int, group: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _build_plan([1] * n, group, block_m, device)


def _build_plan(lens: list[int], group: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    seqs: list[int] = []
    rows: list[int] = []
    for i, n in enumerate(lens):
        for r in range(0, n * group, block_m):
            seqs.append(i)
            rows.append(r)
    order = sorted(range(len(seqs)), key=lambda t: -rows[t])
    tab = torch.tensor([[seqs[t] for t in order], [rows[t] for t in order]], dtype=torch.int32)
    tab = tab.to(device, non_blocking=True)
    return tab[0], tab[1]


def _tables(
    cu: list[int], starts: list[int], kv_offsets: list[int], group: int, block_m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch's device-side inputs: tile table (sequence, first row) and the [3, n+1] table of
    token offsets, start positions and key-0 rows."""
    tile_seq, tile_row = _plan([b - a for a, b in pairwise(cu)], group, block_m, device)
    meta = torch.tensor([cu, [*starts, 0], [*kv_offsets, 0]], dtype=torch.int64).to(device, non_blocking=True)
    return tile_seq, tile_row, meta


def split_schedule(
    programs: int, segments: int, decode: bool, sm_count: int, split: bool | None = None, scratch_bytes: int = 0
) -> int:
    """Programs per (tile, kv head) over key segments: 0 = one launch (each program walks all its segments),
    else the split launch with that many segment programs. A schedule choice, never an arithmetic one.

    ``split`` None: split a decode step whose ``programs`` (tiles x kv heads) fill at most a quarter of the
    SMs, whose key capacity spans more than one segment and whose ``scratch_bytes`` fit
    :data:`SPLIT_SCRATCH_BYTES`; True / False force it. (At batch 16 with 8 kv heads, 128 programs on 132 SMs,
    the split measured slower than one launch: 23.6 against 18.3 us at 640 keys; at batch 1, 9.6 against 17.2.) A split takes about two waves of segment programs. ``segments`` is the static maximum
    (the capacity's), so the grid is the same at every step of a captured decode graph.
    """
    if split is None:
        split = decode and segments > 1 and 4 * programs <= sm_count and scratch_bytes <= SPLIT_SCRATCH_BYTES
    return min(segments, triton.cdiv(2 * sm_count, programs)) if split else 0


def prepare(
    q: torch.Tensor,
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    gate: torch.Tensor | None,
    cu: list[int],
    starts: list[int],
    kv_offsets: list[int],
    scale: float,
    kv_block: int,
    config: AttentionTileConfig | None,
    tables: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    *,
    block_tables: torch.Tensor | None = None,
    page: int = 0,
    seq_meta: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_capacity: int | None = None,
    split: bool | None = None,
    seg_blocks: int = SEG_BLOCKS,
    segment_programs: int | None = None,
) -> tuple[Callable[[], object], torch.Tensor]:
    """The kernel launch(es) as a closure (host planning done) and the output tensor; the benchmark times the closure.

    k_src/v_src ``[rows, Hkv, D]`` (packed tokens or a flattened cache); key 0 of sequence i is row kv_offsets[i].
    Paged (``page`` > 0): k_src/v_src are a flattened pool of ``page``-token blocks, ``block_tables`` a
    contiguous ``[rows, width]`` int tensor of block ids, and kv_offsets[i] the element offset of
    sequence i's table row in it (:func:`attention_with_paged_kv_cache`).
    ``tables(group, block_m)``: the :func:`_tables` of these lists, from a cache shared by a step's
    layers (the same values, so the same launch); without it they are built here.
    ``seq_meta``: device ``(cu_seqlens, start positions)`` the kernel reads instead of the host-built
    rows of ``tables``' metadata (the same values): a captured decode graph replays with new
    positions written into those tensors, so they cannot be baked into a table built at capture.
    ``kv_capacity``: the most keys any sequence can have (default: the host lists' longest), which sizes
    the split schedule's segment axis and scratch; static where the host starts are placeholders.
    ``split``: None = :func:`split_schedule`; True / False force the split / one-launch schedule (same
    bits). ``segment_programs``: the split's programs per (tile, kv head), for tests and benchmarks.
    ``seg_blocks``: key blocks per segment, part of the arithmetic (:data:`SEG_BLOCKS` in the contract;
    another value is for tuning experiments only).
    """
    T, hq, dim = q.shape
    hkv = k_src.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    lens = [b - a for a, b in pairwise(cu)]
    if T == 0 or not any(lens):
        return (lambda: None), out
    decode = max(lens) == 1
    cfg = _config(q.dtype, dim, config, decode=decode)
    if kv_block < 16 or kv_block > MAX_KV_BLOCK or kv_block & (kv_block - 1):
        raise ValueError(f"attention_triton: kv_block={kv_block} must be a power of two in [16, {MAX_KV_BLOCK}]")
    if not isinstance(seg_blocks, int) or seg_blocks < 1:
        raise ValueError(f"attention_triton: seg_blocks={seg_blocks!r} must be a positive int (kv blocks per segment)")
    if k_src.stride(-1) != 1 or v_src.stride() != k_src.stride() or q.stride(-1) != 1:
        raise ValueError("attention_triton: q/k/v (or the cache) need a contiguous last dim and equal k/v strides")
    longest = max(s + n for s, n in zip(starts, lens, strict=True))
    if kv_capacity is None:
        kv_capacity = longest
    elif kv_capacity < longest:
        raise ValueError(f"attention_triton: kv_capacity={kv_capacity} is below a sequence's {longest} keys")
    if tables is None:
        tile_seq, tile_row, meta = _tables(cu, starts, kv_offsets, group, cfg.block_m, q.device)
    else:
        tile_seq, tile_row, meta = tables(group, cfg.block_m)
    if (page > 0) != (block_tables is not None):
        raise ValueError(f"attention_triton: page={page} and block_tables go together (page > 0 with a table)")
    gated = gate is not None
    g = gate if gated else q
    if gated and gate.stride(-1) != 1:
        g = gate.contiguous()
    n_tiles = tile_seq.numel()
    seg_max = triton.cdiv(kv_capacity, seg_blocks * kv_block)
    if segment_programs is not None:
        if split is False or not 1 <= segment_programs <= seg_max:
            raise ValueError(
                f"attention_triton: segment_programs={segment_programs} needs split and 1..{seg_max} (segments)"
            )
        progs = segment_programs
    else:
        scratch = T * hq * seg_max * (dim + 2) * 4
        progs = split_schedule(n_tiles * hkv, seg_max, decode, sm_count(q.device), split, scratch)
    tile_args = (tile_seq, tile_row, *(meta[:2] if seq_meta is None else seq_meta), meta[2])
    bt = meta[2] if block_tables is None else block_tables
    shape = dict(
        GROUP=group, D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=cfg.block_m, BLOCK_N=kv_block,
        SEG_BLOCKS=seg_blocks, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    numerics = dict(
        P_LOWP=q.dtype != torch.float32 and not _INTERPRET, IEEE=q.dtype == torch.float32,
        CAST_F32=_INTERPRET and q.dtype != torch.float32, PAGE=page,
    )  # fmt: skip
    gating = dict(GATED=gated, GATE_PER_DIM=gated and gate.shape[-1] != 1)
    qk_scale = float(scale) * _LOG2E
    if not progs:
        return functools.partial(
            _attend_kernel[(n_tiles, hkv)],
            q, k_src, v_src, g, out, *tile_args, bt,
            q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1), g.stride(0), g.stride(1),
            out.stride(0), out.stride(1), qk_scale, **shape, **numerics, **gating,
        ), out  # fmt: skip
    # fp32 scratch: each (token, query head) row's (m, l, acc) per segment; a segment no program reaches is
    # never read (the combine walks the tile's segments up to its last position only).
    seg_m = torch.empty(T * hq, seg_max, device=q.device, dtype=torch.float32)
    seg_l = torch.empty_like(seg_m)
    seg_acc = torch.empty(T * hq, seg_max, dim, device=q.device, dtype=torch.float32)
    segments = functools.partial(
        _segments_kernel[(n_tiles, hkv, progs)],
        q, k_src, v_src, seg_m, seg_l, seg_acc, *tile_args, bt,
        q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1), qk_scale, hq, seg_max, **shape, **numerics,
    )  # fmt: skip
    combine = functools.partial(
        _combine_kernel[(n_tiles, hkv)],
        g, out, seg_m, seg_l, seg_acc, *tile_args,
        g.stride(0), g.stride(1), out.stride(0), out.stride(1), hq, seg_max, **shape, **gating,
    )  # fmt: skip

    def call() -> None:
        segments()
        combine()

    return call, out


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
    """Append each sequence's new k/v at ``starts[i]..`` of cache row ``slot_ids[i]`` (one scatter, exact copy).

    ``dst``: :func:`write_index` of these lists, if the caller already has it."""
    if dst is None:
        dst = write_index(cu, starts, slot_ids, k_cache.shape[1], k.device)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, dst, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, dst, v)


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
            cfg = table[dt]
            c[f"{name}_{label}"] = [cfg.block_m, cfg.num_warps, cfg.num_stages]
        for label, table in wide_tables:
            cfg = table[dt]
            c[f"{name}_{label}_head_dim_gt_{WIDE_HEAD_DIM}"] = [cfg.block_m, cfg.num_warps, cfg.num_stages]
    return c


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
        constants={**_constants(), "cache_write": "before attention (index_copy_); cache dtype == k dtype"},
        cases=("prefill", "decode"),
        equivalence_note=_NOTE,
        probe=_probe_kvcache,
    )
)

__all__ = [
    "CONFIGS",
    "AttentionTileConfig",
    "attention_varlen",
    "attention_with_kv_cache",
    "attention_with_paged_kv_cache",
    "write_cache",
    "write_index",
]
