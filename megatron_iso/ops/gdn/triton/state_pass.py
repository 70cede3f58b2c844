"""The state pass: per chunk the prep kernel (G, T^{-1} and the WY or substitution operands), then per sequence the
chain kernel from chunk to chunk (entry state -> exit state; chunk form: u by block forward substitution). Package
docstring, "State pass"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.gdn.triton import tuning
from megatron_iso.ops.gdn.triton.plan import Plan
from megatron_iso.ops.gdn.triton.tiles import (
    beta_rows,
    chunk_gates,
    chunk_row,
    k_tile,
    kk_rows,
    subst_operands,
    subst_y,
    v_tile,
)
from megatron_iso.ops.gdn.triton.tuning import GDNConfig, dot, fp_options, maxnreg


@triton.jit
def _wy_rows(
    k_ptr, v_ptr, b_ptr, bk_ptr, bvv_ptr, bb_ptr, tr_ptr, bce_ptr, u0_ptr, w_ptr,
    kcf, bc, cum, row0, brow0, nbuf, nrows, SK, SV, SB, HK, HV, DK, DV, hk, h, base,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr, STORE_U0: tl.constexpr,
):  # fmt: skip
    """The chunk's U0 = T^{-1} (beta v) (STORE_U0: the scan form's chain reads it; the chunk form's computes its own
    R, :func:`subst_y`) and W = T^{-1} (beta e^G k), T^{-1} read from ``tr_ptr`` (row r at ``tr_ptr + r * C``), into
    this (chunk, head)'s U0 and W. With a tensor-core PREC whole-K dots (``kcf``: the chunk's k tile); ieee: K-blocked
    over the chunk's tokens (KB at a time, ascending), v, k and beta e^G (``bce_ptr``, this program's scratch)
    reloaded per block."""
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BVF)
    if PREC != "ieee":
        ti = tl.load(tr_ptr + ot[:, None] * C + ot[None, :])
        if STORE_U0:
            vcf = v_tile(v_ptr, bvv_ptr, ot, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
            u0 = dot(ti, bc[:, None] * vcf, None, PREC)
            tl.store((u0_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], u0)
        w = dot(ti, (bc * tl.exp(cum))[:, None] * kcf, None, PREC)
        tl.store((w_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :], w.to(w_ptr.dtype.element_ty))
    else:
        ob = tl.arange(0, KB)
        tl.store(bce_ptr + base * C + ot, bc * tl.exp(cum))
        tl.debug_barrier()  # other threads' scratch stores are read below
        # Two loops (not one): each holds one accumulator and one T^{-1} block, not two of each.
        if STORE_U0:
            u0 = tl.zeros([C, BVF], dtype=tl.float32)
            for tb in range(C // KB):
                otb = tb * KB + ob  # this block's tokens: the dot's K index
                ti = tl.load(tr_ptr + ot[:, None] * C + otb[None, :])
                vcb = v_tile(v_ptr, bvv_ptr, otb, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
                bcb = beta_rows(b_ptr, bb_ptr, otb, row0, brow0, nbuf, nrows, SB, HV, h)
                u0 = dot(ti, bcb[:, None] * vcb, u0, PREC)
            tl.store((u0_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], u0)
        w = tl.zeros([C, BK], dtype=tl.float32)
        for tb in range(C // KB):
            otb = tb * KB + ob
            ti = tl.load(tr_ptr + ot[:, None] * C + otb[None, :])
            kcb = k_tile(k_ptr, bk_ptr, otb, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
            bce = tl.load(bce_ptr + base * C + otb)
            w = dot(ti, bce[:, None] * kcb, w, PREC)
        tl.store((w_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :], w.to(w_ptr.dtype.element_ty))


@triton.jit
def _prep_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, chunk_ptr,
    u0_ptr, w_ptr, kd_ptr, egc_ptr, gcum_ptr, tinv_ptr, bce_ptr, s_ptr, kp_ptr,
    SK, SV, SG, SB, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr, PREC: tl.constexpr,
    SUBST: tl.constexpr, WY: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): KD = e^{G_C-G} k, e^{G_C}, G (for the chunk-form output) and what the chain reads.
    Scan form (SUBST False): U0 and W of the WY form and T^{-1} (``tinv_ptr``: the program's scratch, T^{-1} at the
    end). Chunk form (SUBST): the operands of the chain's block forward substitution (docs/GDN.md,
    "Substitution"): ``S`` into ``s_ptr`` (in ``GDNConfig.mid_dtype``: A's blocks below the diagonal and ``X_bb``,
    T^{-1}'s diagonal blocks, on it), ``beta v`` over U0 (fp32) and ``beta e^G k`` into ``kp_ptr`` (mid dtype); with
    WY (a training call: the backward reads them) also W and the whole T^{-1}.

    chunk row (int32 x CHUNK_COLS): packed row of the chunk's token 0 (tokens >= ``buffered`` are packed rows
    ``row0 + t``), ``buffered`` (tokens 0..buffered-1 are in the state cache buffer), buffer row base, ``nrows``
    (tokens present: C for a closing chunk; rows from ``nrows`` on load as zeros, which leaves rows < nrows bitwise
    as they are in the full chunk, docs/GDN.md "Chunk form"), and a flag read by ``_buffer_kernel`` only.

    With an ieee PREC the dots run over K in blocks of KB with the accumulator carried in ascending k order (module
    docstring, "K-blocked dots"); their operand blocks are (re)loaded from memory: k and v from the inputs (the
    same fp32 values), T^{-1} and beta e^G from this program's scratch rows ``tinv_ptr``/``bce_ptr``.
    Packed k/v/g/beta are read in their own dtype at row strides SK..SB and converted exactly to fp32 (the
    buffer is fp32). PREC: the dots' ``input_precision`` (``GDNConfig.prep_precision``). A decode step computes
    one row of the same terms: ``_decode_prep_kernel``.
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // REP
    row0, nbuf, brow0, nrows = chunk_row(chunk_ptr, cid)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    in_buf = ot < nbuf
    present = ot < nrows
    bc, cum = chunk_gates(g_ptr, b_ptr, bg_ptr, bb_ptr, row0 + ot, brow0 + ot, in_buf, present, SG, SB, HV, h, C)
    gl = tl.sum(tl.where(ot == C - 1, cum, 0.0), axis=0)  # G_C
    lower = ot[:, None] > ot[None, :]
    base = cid * HV + h
    tl.store(gcum_ptr + base * C + ot, cum)
    dkd = tl.exp(gl - cum)
    if PREC == "ieee":
        kcf = tl.zeros([C, BK], dtype=tl.float32)  # not read: the ieee path reloads k in blocks
    else:  # tensor cores: whole-K dots (MMA operands are staged through shared memory, nothing to spill)
        kcf = k_tile(k_ptr, bk_ptr, ot, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
    kk = kk_rows(k_ptr, bk_ptr, ot, kcf, kcf, kd_ptr, base, dkd, row0, brow0, nbuf, nrows, SK, HK, DK, hk,
                  C, BK, KB, PREC, C, True)  # fmt: skip
    a = tl.where(lower, bc[:, None] * tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)) * kk, 0.0)
    # T^{-1} for T = I + A (unit lower triangular) by blocks of IB rows (docs/GDN.md, "Triangular inverse").
    # A goes to the scratch rows first: the diagonal blocks are read row by row, the blocks below by dots.
    tbase = tinv_ptr + base * C * C
    tile = ot[:, None] * C + ot[None, :]
    tl.store(tbase + tile, a)
    tl.debug_barrier()
    ob3 = tl.arange(0, C // IB)
    os3 = tl.arange(0, IB)
    # Every diagonal block at once, row s after row s-1, in the scratch over A's rows: X_s = e_s - sum_{r<s} A_sr X_r
    # as one explicit fma chain over r ascending per element (no reduction whose order follows a layout, so one row
    # can be recomputed alone with the same bits: _decode_prep_kernel). Row s of A is read before row s of X
    # replaces it.
    diag = (ob3[:, None] * IB) * C + ob3[:, None] * IB + os3[None, :]  # [NB, IB]: row 0 of each block
    tl.store(tbase + diag, tl.where(os3[None, :] == 0, 1.0, 0.0))  # A's row 0 of a block is 0 there: X_0 = e_0
    tl.debug_barrier()
    for srow in tl.static_range(1, IB):
        acc = tl.zeros([C // IB, IB], dtype=tl.float32)
        for r in tl.static_range(srow):
            a_sr = tl.load(tbase + (ob3 * IB + srow) * C + ob3 * IB + r)
            acc = tl.fma(a_sr[:, None], tl.load(tbase + diag + r * C), acc)
        x_s = tl.where(os3[None, :] == srow, 1.0, 0.0) - acc
        tl.debug_barrier()  # row srow of A is read by every thread before it is overwritten
        tl.store(tbase + diag + srow * C, x_s)
        tl.debug_barrier()
    if SUBST:  # the scratch holds S now: A below the diagonal blocks, X_bb on them, zeros above
        tl.store(s_ptr + base * C * C + tile, tl.load(tbase + tile).to(s_ptr.dtype.element_ty))
        ov = tl.arange(0, BVF)
        if PREC == "ieee":  # beta v and beta e^G k by row blocks (k is not in registers; G's rows as stored above)
            for rb0 in tl.static_range(0, C, IB):
                rb = rb0 + os3
                vblk = v_tile(v_ptr, bvv_ptr, rb, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
                bcb = beta_rows(b_ptr, bb_ptr, rb, row0, brow0, nbuf, nrows, SB, HV, h)
                kblk = k_tile(k_ptr, bk_ptr, rb, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
                bv, kp = subst_operands(bcb, tl.load(gcum_ptr + base * C + rb), kblk, vblk)
                tl.store((u0_ptr + base * C * BVF) + rb[:, None] * BVF + ov[None, :], bv)
                tl.store((kp_ptr + base * C * BK) + rb[:, None] * BK + ok[None, :], kp.to(kp_ptr.dtype.element_ty))
        else:  # whole tiles: k, beta and G are in registers
            vcf = v_tile(v_ptr, bvv_ptr, ot, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
            bv, kp = subst_operands(bc, cum, kcf, vcf)
            tl.store((u0_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], bv)
            tl.store((kp_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :], kp.to(kp_ptr.dtype.element_ty))
    if WY:
        # Block rows below: X_i. = -X_ii (sum_{j<i} A_ij X_j.), K-blocked over j (ascending), from A's blocks still in
        # the scratch; columns at and right of the diagonal block keep X_ii and A's zeros.
        for ib in tl.static_range(1, C // IB):
            ri = ib * IB + os3
            rsum2 = tl.zeros([IB, C], dtype=tl.float32)
            for jb in tl.static_range(ib):
                rj = jb * IB + os3
                rsum2 = dot(tl.load(tbase + ri[:, None] * C + rj[None, :]),
                             tl.load(tbase + rj[:, None] * C + ot[None, :]), rsum2, PREC)  # fmt: skip
            x_i = -dot(tl.load(tbase + ri[:, None] * C + ri[None, :]), rsum2, None, PREC)
            tl.debug_barrier()  # row block ib of A is read by every thread before it is overwritten
            tl.store(tbase + ri[:, None] * C + ot[None, :], x_i, mask=(ot < ib * IB)[None, :])
            tl.debug_barrier()
        _wy_rows(
            k_ptr, v_ptr, b_ptr, bk_ptr, bvv_ptr, bb_ptr, tbase, bce_ptr, u0_ptr, w_ptr,
            kcf, bc, cum, row0, brow0, nbuf, nrows, SK, SV, SB, HK, HV, DK, DV, hk, h, base,
            C, BK, BVF, KB, PREC, not SUBST,
        )  # fmt: skip
    tl.store(egc_ptr + base, tl.exp(gl))


@triton.jit
def _chain_kernel(
    chain_ptr, entry_ptr, entry_bf16_ptr, u0_ptr, u_ptr, w_ptr, kd_ptr, egc_ptr, ex_ptr, chunk_ptr, s_ptr, kp_ptr,
    by_ptr, HV, DK, DV,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr,
    PREC: tl.constexpr, ENTRIES: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, Dv block): entry -> exit state over the sequence's chunks.

    chain row (int32 x 6): first chunk index, number of chunks, entry kind (0 zeros / 1 entry_ptr
    row), entry row (the slot), write back (1: store the last state into entry_ptr's row; with ENTRIES also its bf16
    rounding into entry_bf16_ptr's, ``GDNLayerState.entry_bf16``), last open (1: the last chunk does not close; its
    u is computed and stored, its exit state is not).

    Scan form (``ex_ptr`` row of chunk j: its exit state, which the scan starts from): the WY form per chunk,
    ``u = U0 - W E`` for all C rows (K = BK in blocks of KB, E's row blocks read back once each from the state this
    program stored last: the entry row or the previous chunk's exit row), then ``E' = dot(KD_b^T, u_b, E')`` over
    ascending row blocks b of u from ``e^{G_C} E`` (docs/GDN.md, "K-blocked dots"). Each output element is one fma
    chain (k ascending from 0 for W E, t ascending from ``e^{G_C} E`` for E'). With a tensor-core PREC
    (tf32x3, tf32) the chunk is two dots over the whole K, E and u straight from registers (the compiler stages MMA
    operands through shared memory). PREC: the dots' ``input_precision`` (``GDNConfig.chain_precision``).

    Chunk form (ENTRIES; ``ex_ptr`` row of chunk j: its entry state, which the output kernel reads): u by block
    forward substitution (docs/GDN.md, "Substitution"), for each IB-row block b in order
    ``Y_b = R_b - sum_{j<b} A_bj u_j`` (:func:`subst_y`; the sum as dots accumulated over j ascending) and
    ``u_b = X_bb Y_b``, A's and X_bb's blocks from the prep's ``S`` (``s_ptr``), ``beta v`` from ``u0_ptr`` and
    ``beta e^G k`` from ``kp_ptr`` (the prep's), the earlier u blocks from registers
    (a tuple: through memory the chain takes twice as long); u into ``u_ptr``,
    and ``E' = e^{G_C} E + sum_b KD_b^T u_b`` (dots accumulated over b ascending). The Y rows of a chunk the call
    leaves open (chunk row flag) go to the state cache's ``by_ptr`` (buf_y) for the decode steps that follow.
    A decode step computes its token's row of each of these dots (``_decode_row_block``).
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    c0 = tl.load(chain_ptr + cid * 6).to(tl.int64)
    nc = tl.load(chain_ptr + cid * 6 + 1)
    ekind = tl.load(chain_ptr + cid * 6 + 2)
    erow = tl.load(chain_ptr + cid * 6 + 3).to(tl.int64)
    wb = tl.load(chain_ptr + cid * 6 + 4)
    last_open = tl.load(chain_ptr + cid * 6 + 5)
    ok = tl.arange(0, BK)
    ob = tl.arange(0, KB)
    oi = tl.arange(0, IB)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    st = (h * DK + ok[:, None]) * DV + ov[None, :]
    hsz = HV * DK * DV
    if ekind == 1:  # noqa: SIM108  (a run-time branch inside the kernel)
        e = tl.load(entry_ptr + erow * hsz + st, mask=m2, other=0.0)
    else:
        e = tl.zeros([BK, BV], dtype=tl.float32)
    oc = tl.arange(0, C)
    for j in range(nc):
        base = (c0 + j) * HV + h
        egc = tl.load(egc_ptr + base)
        first = j == 0
        closes = (j < nc - 1) | (last_open == 0)
        if ENTRIES:
            tl.store(ex_ptr + (c0 + j) * hsz + st, e.to(ex_ptr.dtype.element_ty), mask=m2)
            _, nbuf, brow0, nrows = chunk_row(chunk_ptr, c0 + j)
            keep_y = tl.load(chunk_ptr + (c0 + j) * 5 + 4) == 1  # a chunk the call leaves open
            us = ()
            en = egc * e
            for b in tl.static_range(C // IB):
                rb = b * IB + oi
                srow = s_ptr + (base * C + rb[:, None]) * C
                acc = tl.zeros([IB, BV], dtype=tl.float32)
                for jb in tl.static_range(b):
                    acc = dot(tl.load(srow + (jb * IB + oi)[None, :]), us[jb], acc, PREC)
                bv = tl.load(u0_ptr + (base * C + rb[:, None]) * BVF + ov[None, :], mask=mv[None, :], other=0.0)
                kp = tl.load(kp_ptr + (base * C + rb[:, None]) * BK + ok[None, :])
                y = subst_y(bv, kp, e, acc, PREC)
                new_y = keep_y & (rb >= nbuf) & (rb < nrows)
                tl.store((by_ptr + (brow0 * HV + h) * DV) + rb[:, None] * (HV * DV) + ov[None, :],
                         y.to(by_ptr.dtype.element_ty), mask=new_y[:, None] & mv[None, :])  # fmt: skip
                ub = dot(tl.load(srow + rb[None, :]), y, None, PREC)
                tl.store(u_ptr + (base * C + rb[:, None]) * BVF + ov[None, :], ub.to(u_ptr.dtype.element_ty),
                         mask=mv[None, :])  # fmt: skip
                us = us + (ub,)  # noqa: RUF005  (Triton 3.6 compiles tuple +, not a starred tuple)
                en = dot(tl.trans(tl.load(kd_ptr + (base * C + rb[:, None]) * BK + ok[None, :])), ub, en, PREC)
            # an open chunk's exit is computed and dropped: a run-time branch around a dot crashed Triton 3.6's
            # prefetch pass at tf32 (chunk 16, Dk 32)
            e = tl.where(closes, en, e)
        elif PREC == "ieee":
            # d = W E for all C rows at once, K = BK in blocks of KB: each row block of E is loaded once per chunk.
            d = tl.zeros([C, BV], dtype=tl.float32)
            for kb in range(BK // KB):
                okb = kb * KB + ob
                wblk = tl.load(w_ptr + (base * C + oc[:, None]) * BK + okb[None, :])
                sb = (h * DK + okb[:, None]) * DV + ov[None, :]
                mb2 = (okb[:, None] < DK) & mv[None, :]
                # E's rows okb: masked lanes read 0.0, as the register state holds +0 there.
                e_in = tl.load(entry_ptr + erow * hsz + sb, mask=mb2 & first & (ekind == 1), other=0.0)
                e_ex = tl.load(ex_ptr + (c0 + tl.maximum(j - 1, 0)) * hsz + sb, mask=mb2 & (j > 0), other=0.0)
                e_blk = tl.where(first, e_in, e_ex)
                d = dot(wblk, e_blk, d, PREC)
            # u = U0 - W E goes to memory (this program's columns, read by no one else), so the state update below
            # can read u back in row blocks.
            tile = (base * C + oc[:, None]) * BVF + ov[None, :]
            u = tl.load(u0_ptr + tile, mask=mv[None, :], other=0.0) - d
            tl.store(u_ptr + tile, u.to(u_ptr.dtype.element_ty), mask=mv[None, :])
            tl.debug_barrier()  # u's rows stored by other threads are read below
            if closes:
                acc = egc * e
                for mb in range(C // KB):
                    om = mb * KB + ob
                    ub = tl.load(u_ptr + (base * C + om[:, None]) * BVF + ov[None, :], mask=mv[None, :], other=0.0)
                    kd = tl.load(kd_ptr + (base * C + om[:, None]) * BK + ok[None, :])
                    acc = dot(tl.trans(kd), ub, acc, PREC)
                e = acc
        else:  # tensor cores: two dots over the whole K per chunk, E and u from registers
            wfull = tl.load(w_ptr + (base * C + oc[:, None]) * BK + ok[None, :])
            tile = (base * C + oc[:, None]) * BVF + ov[None, :]
            u = tl.load(u0_ptr + tile, mask=mv[None, :], other=0.0) - dot(wfull, e, None, PREC)
            kdfull = tl.load(kd_ptr + (base * C + oc[:, None]) * BK + ok[None, :])
            e = tl.where(closes, dot(tl.trans(kdfull), u, egc * e, PREC), e)
        if not ENTRIES:
            tl.store(ex_ptr + (c0 + j) * hsz + st, e, mask=m2)
            if PREC == "ieee":
                tl.debug_barrier()  # the next chunk reads this state's row blocks stored by other threads
    if wb == 1:
        tl.store(entry_ptr + erow * hsz + st, e, mask=m2)
        if ENTRIES:
            tl.store(entry_bf16_ptr + erow * hsz + st, e.to(tl.bfloat16), mask=m2)


def prep_outputs(n: int, hv: int, cfg: GDNConfig, dev: torch.device, wy: bool = True) -> tuple[torch.Tensor, ...]:
    """U0, W, KD, e^{G_C}, G of ``n`` chunks (W and KD in ``cfg.mid_dtype``, the rest fp32). Without ``wy`` (a decode
    step, which writes neither) U0 and W are KD itself, allocated once."""
    c = cfg.chunk
    kd = torch.empty(n, hv, c, cfg.bk, dtype=cfg.mid_dtype, device=dev)
    return (
        torch.empty(n, hv, c, cfg.bv_full, dtype=torch.float32, device=dev) if wy else kd,
        torch.empty_like(kd) if wy else kd,
        kd,
        torch.empty(n, hv, dtype=torch.float32, device=dev),
        torch.empty(n, hv, c, dtype=torch.float32, device=dev),
    )


def prep_chunks(
    rows: tuple[tuple[torch.Tensor, int], ...],
    buffers: tuple[torch.Tensor, ...],
    chunks: torch.Tensor,
    cfg: GDNConfig,
    wy: bool = True,
) -> tuple[torch.Tensor, ...]:
    """``_prep_kernel`` over the ``chunks`` table (int32 ``[n, CHUNK_COLS]``: the kernel's chunk rows): U0, W, KD,
    e^{G_C}, G, T^{-1}, S and ``beta e^G k`` of each chunk and value head (:func:`prep_outputs`; T^{-1} fp32, the
    kernel's scratch). Scan form: U0, W and T^{-1} (S and ``beta e^G k`` are placeholders). Chunk form: S,
    ``beta e^G k``, and ``beta v`` in U0's tensor; with ``wy`` (a training call, whose backward reads them) W and
    T^{-1}, else T^{-1} holds S in fp32 and W is not written. ``rows``: k, v, g,
    beta as :func:`.rule._rows` returns them (tensor, row stride); ``buffers``: the state cache's buf_k, buf_v, buf_g,
    buf_beta (any fp32 tensor when no token is buffered)."""
    (kf, sk), (vf, sv), (gf, sg), (bf, sb) = rows
    hk, dk = kf.shape[1:]
    hv, dv = vf.shape[1:]
    n, c, dev = chunks.shape[0], cfg.chunk, kf.device
    u0, w, kd, egc, gcum = terms = prep_outputs(n, hv, cfg, dev)
    tinv = torch.empty(n, hv, c, c, dtype=torch.float32, device=dev)  # the kernel's scratch, T^{-1} at the end
    bce = torch.empty(n, hv, c, dtype=torch.float32, device=dev)  # scratch
    subst = cfg.form == "chunk"
    s = torch.empty(n, hv, c, c, dtype=cfg.mid_dtype, device=dev) if subst else tinv
    kp = torch.empty_like(kd) if subst else kd
    _prep_kernel[(n, hv)](
        kf, vf, gf, bf, *buffers, chunks, u0, w, kd, egc, gcum, tinv, bce, s, kp, sk, sv, sg, sb, hk, hv, dk, dv,
        hv // hk,
        C=c, BK=cfg.bk, BVF=cfg.bv_full, KB=cfg.kb, IB=cfg.inv_block, PREC=cfg.prep_precision, SUBST=subst,
        WY=wy or not subst, num_warps=tuning.PREP_WARPS, num_stages=tuning.PREP_STAGES, **maxnreg(tuning.PREP_MAXNREG),
        **fp_options(cfg.form),
    )  # fmt: skip
    return (*terms, tinv, s, kp)


def state_rows(nchunks: int, hv: int, dk: int, dv: int, cfg: GDNConfig, dev: torch.device) -> torch.Tensor:
    """The chain's ``ex`` rows (one state per chunk): fp32 exit states (scan form, the scan starts from them) or
    entry states in ``cfg.mid_dtype`` (chunk form, read by dots only)."""
    dtype = cfg.mid_dtype if cfg.form == "chunk" else torch.float32
    return torch.empty(max(nchunks, 1), hv, dk, dv, dtype=dtype, device=dev)


def no_state(ex: torch.Tensor) -> torch.Tensor:
    """What a call without a state cache passes for its fp32 buffers and entry/running rows (never read or written:
    no buffered tokens, no buffer rows): fp32 like the real ones, so training and decode launch the same compiled
    kernels. ``ex`` itself when it is fp32 (the scan form's)."""
    return ex if ex.dtype == torch.float32 else torch.empty(1, dtype=torch.float32, device=ex.device)


def no_entries(ex: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's ``entry`` / ``entry_bf16`` pointers of a call without a state cache (never read or written: no
    chain writes back): fp32 and bf16 like the cache's, for the same compiled kernels."""
    return no_state(ex), torch.empty(1, dtype=torch.bfloat16, device=ex.device)


def state_pass(
    plan: Plan,
    prep_rows: tuple,
    buffers: tuple,
    entries: tuple[torch.Tensor, torch.Tensor],
    ex: torch.Tensor,
    cfg: GDNConfig,
    buf_y: torch.Tensor | None = None,
    wy: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Prep and chain kernels over a plan's chunks and chains: u (chunk form; the scan form: U0), W, KD, e^{G_C}, G
    and T^{-1} per chunk (:func:`prep_chunks`, ``wy`` as there); ``ex`` (:func:`state_rows`) gets each chunk's exit
    (scan form) or entry state (chunk form). The chunk form's u is a tensor of its own in ``cfg.mid_dtype``, or over
    U0 when that is fp32. ``entries``: the state cache's ``entry`` and ``entry_bf16`` (without a cache,
    :func:`no_entries`); ``buf_y``: the cache's (chunk form: the chain stores the Y rows of a chunk left open)."""
    # no chunk: a chain may still store its (zero) entry state into the cache
    terms = prep_chunks(prep_rows, buffers, plan.chunks, cfg, wy) if plan.nchunks else (ex,) * 8
    u0, w, kd, egc, gcum, tinv, s, kp = terms
    own_u = plan.nchunks and cfg.form == "chunk" and cfg.mid_bf16
    u = torch.empty(u0.shape, dtype=cfg.mid_dtype, device=u0.device) if own_u else u0
    hv, dk, dv = ex.shape[1:]
    if plan.nchains:
        _chain_kernel[(plan.nchains, hv, triton.cdiv(dv, cfg.chain_bv))](
            plan.chains, *entries, u0, u, w, kd, egc, ex, plan.chunks, s, kp, u if buf_y is None else buf_y, hv, dk, dv,
            C=cfg.chunk, BK=cfg.bk, BVF=cfg.bv_full, BV=cfg.chain_bv, KB=cfg.kb, IB=cfg.inv_block,
            PREC=cfg.chain_precision, ENTRIES=cfg.form == "chunk", num_warps=tuning.CHAIN_WARPS,
            num_stages=tuning.CHAIN_STAGES, **maxnreg(tuning.CHAIN_MAXNREG), **fp_options(cfg.form),
        )  # fmt: skip
    return u, w, kd, egc, gcum, tinv
