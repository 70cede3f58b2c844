"""The invariant causal attention's Triton kernels (correctness profile, cuda) and their numerical policy.

The host side: :mod:`megatron_iso.ops.attention.attention_triton` (the three cases, the contract registration) over
:mod:`megatron_iso.ops.attention.forward_launch_triton` (tile configs and tables, the schedule choice, the launches).
Invariant kept: a query position's arithmetic is set by the position alone: key blocks and segments aligned at key
0, online softmax in fp32 in ascending order, a fixed row-sum tree, segments merged in ascending order with explicit
fmas, one rounding of ``div_rn(ACC, L)``. Tile configs, parking and the split-over-keys decode schedule move no bit.

Design: docs/KERNELS.md, "Attention forward kernels".
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_iso.ops.common.tree_triton import fixed_tree_rowsum


@triton.jit
def _program_rows(
    tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The program's tile (grid axis 0) and kv head ``hkv`` (axis 1): BLOCK_M rows (token, query head of ``hkv``'s
    group) of one sequence, and the head-dim lanes ``d`` (``d_ok``: below D). Every kernel starts here."""
    tile = tl.program_id(0)
    hkv = tl.program_id(1)
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
    d = tl.arange(0, BLOCK_D)
    return tile, hkv, tok0, start + n, kv_off, tok, head, row_ok, start + tok, last_pos, d, d < D


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
def _program_kv(
    q_ptr, k_ptr, v_ptr, tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAST_F32: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """The start of a program that walks keys (:func:`_attend_kernel`, :func:`_segments_kernel`): its rows
    (:func:`_program_rows`), their q, its kv head's key/value bases and the key blocks up to the tile's last
    position."""
    tile, hkv, tok0, kv_len, kv_off, tok, head, row_ok, pos, last_pos, d, d_ok = _program_rows(
        tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, GROUP, BLOCK_M, D, BLOCK_D
    )
    q = _load_q(q_ptr, tok0, tok, head, row_ok, d, d_ok, stride_qt, stride_qh, CAST_F32)
    kv_base_k, kv_base_v = _kv_bases(k_ptr, v_ptr, hkv, kv_off, stride_kt, stride_kh, PAGE)
    n_blocks = last_pos // BLOCK_N + 1
    return tile, hkv, tok0, kv_len, kv_off, tok, head, row_ok, pos, last_pos, d, d_ok, q, kv_base_k, kv_base_v, n_blocks


@triton.jit
def _cta_barrier(x, ASM: tl.constexpr):
    """Every thread of the program waits here (``bar.sync 0``), and earlier global stores of any of its threads
    are visible to all of them after it; returns int32 0 to add to an address that must be read after it.
    Inline PTX, not ``tl.debug_barrier()``, which keeps triton from software-pipelining the key loop around it.
    ``ASM`` False (the interpreter, which runs a program's ops in order and has no inline asm): nothing to wait
    for."""
    if ASM:
        return tl.inline_asm_elementwise(
            "bar.sync 0;\n\tmov.u32 $0, 0;", "=r,r", [x.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1
        )
    return 0


@triton.jit
def _merge_running(
    park, m_run, l_run, acc_run, m, l_sum, acc, seg, row_ok, pos,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr, PARK: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    """Segment ``seg``'s state (m, l_sum, acc) into the running state by :func:`_merge_segment`. ``PARK``: the
    running ACC is not ``acc_run`` but parked at ``park``, read back after a barrier (other threads of the program
    may have stored the elements this thread reads); segment 0 reads nothing (the merge takes the segment's state
    as it is)."""
    seen = row_ok & (seg * (SEG_BLOCKS * BLOCK_N) <= pos)
    if PARK:
        z = _cta_barrier(seg, SYNC)
        acc_run = tl.load(park + z * BLOCK_D, mask=seg > 0, other=0.0)
    return _merge_segment(m_run, l_run, acc_run, m, l_sum, acc, seen, seg == 0)


@triton.jit
def _walk(
    q, park, kv_base_k, kv_base_v, bt_ptr, kv_off, kv_len, pos, row_ok, d, d_ok, n_blocks, stride_kt, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr,
    STAGES: tl.constexpr, P_LOWP: tl.constexpr, IEEE: tl.constexpr, CAST_F32: tl.constexpr, PAGE: tl.constexpr,
    PARK: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    """The one-launch walk of :func:`_attend_kernel`: every key block in ascending order into the segment's state,
    each segment merged into the running ``(M, L, ACC)`` as it ends; returns the running state.

    ``PARK`` chooses where ACC lives between merges. False: in registers, carried through the key loop with the
    segment's accumulator, and every segment, the last included, merges in the loop. True: in the program's fp32
    scratch tile ``park`` ([BLOCK_M, BLOCK_D] addresses), so only the segment's accumulator is live through the
    key loop (the register form holds both: a 64-row, 4-warp bf16 tile at head dim 128 spills); each segment but
    the last is merged as it ends and the result stored, the last is merged after the loop and stays in registers
    for the output. The same merges, in the same order, of the same floats: a stored and reloaded fp32 is the
    same float. M and L (a float per row) stay in registers either way."""
    m_run, l_run, acc_run = _fresh_state(BLOCK_M, BLOCK_D)
    m, l_sum, acc = _fresh_state(BLOCK_M, BLOCK_D)
    for b in tl.range(0, n_blocks, num_stages=STAGES):
        m, l_sum, acc = _block_step(
            q, m, l_sum, acc, b, kv_base_k, kv_base_v, bt_ptr, kv_off, kv_len, pos, row_ok, d, d_ok, stride_kt,
            qk_scale, BLOCK_M, BLOCK_N, P_LOWP, IEEE, CAST_F32, PAGE,
        )  # fmt: skip
        seg_ends = (b + 1) % SEG_BLOCKS == 0
        if PARK:  # noqa: SIM108 - a constexpr branch. Parked, the last segment merges after the loop
            seg_ends = seg_ends & (b + 1 < n_blocks)
        else:
            seg_ends = seg_ends | (b + 1 == n_blocks)
        if seg_ends:  # merge the segment, start the next
            m_run, l_run, acc_new = _merge_running(
                park, m_run, l_run, acc_run, m, l_sum, acc, b // SEG_BLOCKS, row_ok, pos, BLOCK_D, BLOCK_N,
                SEG_BLOCKS, PARK, SYNC,
            )  # fmt: skip
            if PARK:  # acc_run is never assigned in the loop, so not carried through it
                tl.store(park, acc_new)
            else:
                acc_run = acc_new
            m, l_sum, acc = _fresh_state(BLOCK_M, BLOCK_D)
    if PARK:  # the last segment: its merge stays in registers for the output
        m_run, l_run, acc_run = _merge_running(
            park, m_run, l_run, acc_run, m, l_sum, acc, (n_blocks - 1) // SEG_BLOCKS, row_ok, pos, BLOCK_D, BLOCK_N,
            SEG_BLOCKS, PARK, SYNC,
        )  # fmt: skip
    return m_run, l_run, acc_run


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, o_ptr, park_ptr,
    tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, bt_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, GATE_PER_DIM: tl.constexpr, P_LOWP: tl.constexpr, IEEE: tl.constexpr,
    CAST_F32: tl.constexpr, PAGE: tl.constexpr, PARK: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    """One program walks every key block of its tile and merges each segment as it ends (one launch, :func:`_walk`).
    ``PARK``: the running ACC lives in the program's tile of ``park_ptr`` (fp32 ``[programs, BLOCK_M, BLOCK_D]``,
    program ``tile * kv heads + kv head``) between merges (``SYNC``: its barrier is real, False only under the
    interpreter); else ``park_ptr`` is never read."""
    (
        tile, hkv, tok0, kv_len, kv_off, tok, head, row_ok, pos, _, d, d_ok, q, kv_base_k, kv_base_v, n_blocks
    ) = _program_kv(
        q_ptr, k_ptr, v_ptr, tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, GROUP, BLOCK_M, D, BLOCK_D, BLOCK_N, CAST_F32, PAGE,
    )  # fmt: skip
    park = park_ptr
    if PARK:
        park = park_ptr + (tile * tl.num_programs(1) + hkv).to(tl.int64) * (BLOCK_M * BLOCK_D)
        park += tl.arange(0, BLOCK_M)[:, None] * BLOCK_D + d[None, :]
    _, l_run, acc_run = _walk(
        q, park, kv_base_k, kv_base_v, bt_ptr, kv_off, kv_len, pos, row_ok, d, d_ok, n_blocks, stride_kt, qk_scale,
        BLOCK_M, BLOCK_D, BLOCK_N, SEG_BLOCKS, STAGES, P_LOWP, IEEE, CAST_F32, PAGE, PARK, SYNC,
    )  # fmt: skip
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
    (
        _, _, tok0, kv_len, kv_off, tok, head, row_ok, pos, last_pos, d, d_ok, q, kv_base_k, kv_base_v, n_blocks
    ) = _program_kv(
        q_ptr, k_ptr, v_ptr, tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, GROUP, BLOCK_M, D, BLOCK_D, BLOCK_N, CAST_F32, PAGE,
    )  # fmt: skip
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
    _, _, tok0, _, _, tok, head, row_ok, pos, last_pos, d, d_ok = _program_rows(
        tile_seq_ptr, tile_row_ptr, cu_ptr, start_ptr, kv_off_ptr, GROUP, BLOCK_M, D, BLOCK_D
    )
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
