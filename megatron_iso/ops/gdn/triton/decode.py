"""The chunk form's decode step: a call of one token per sequence computes that token's rows of the training tiles
(docs/GDN.md, "Decode"): ``_decode_prep_kernel`` (G, A's and P's rows, the token's X_bb row), then
``_decode_row_kernel`` (Y, u and output rows, the exit state at a chunk's close)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.gdn.state_cache import GDNLayerState
from megatron_iso.ops.gdn.triton import tuning
from megatron_iso.ops.gdn.triton.plan import Plan
from megatron_iso.ops.gdn.triton.state_pass import prep_outputs
from megatron_iso.ops.gdn.triton.tiles import (
    beta_rows,
    buffer_rows,
    chunk_gates,
    chunk_row,
    kk_rows,
    output_p,
    output_rows_from,
    subst_operands,
    subst_y,
)
from megatron_iso.ops.gdn.triton.tuning import GDNConfig, dot, fp_options, maxnreg


@triton.jit
def _decode_tile(buf_ptr, packed_ptr, rows, cols, t, RS, NCOLS):
    """A decode step's chunk tile (token t: buffered = t, present = t + 1): rows < t from the state cache's buffer
    (``buf_ptr``: row 0, rows RS apart), row t the token's packed row (``packed_ptr``), rows > t and columns >= NCOLS
    zeros. The values :func:`k_tile` and the prep's v tile read there, from one tile of addresses instead of two."""
    cm = cols < NCOLS
    buf = tl.load(buf_ptr + rows[:, None] * RS + cols[None, :], mask=(rows < t)[:, None] & cm[None, :], other=0.0)
    buf = buf.to(tl.float32)
    tok = tl.load(packed_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    return tl.where((rows == t)[:, None], tok[None, :], buf)


@triton.jit
def _token_tile(row_ptr, cols, ncols, mine):
    """A decode step's ROWS-row dot operand holding one row, the token's (``mine``), zeros elsewhere: the values of a
    tile load masked to that row, from one row of addresses instead of ROWS."""
    x = tl.load(row_ptr + cols, mask=cols < ncols, other=0.0)
    return tl.where(mine[:, None], x[None, :], 0.0)


@triton.jit
def _decode_prep_rows(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, bt_ptr, chunk_ptr,
    kd_ptr, egc_ptr, gcum_ptr, p_ptr, a_ptr,
    scale, SQ, SK, SV, SG, SB, HK, HV, DK, DV, REP,
    sid, h,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr, PREC: tl.constexpr,
    OPREC: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Chunk form, a decode step at chunk position t = nrows - 1, for sequence ``sid`` and value head ``h``: the
    rows of ``_prep_kernel``'s terms that the row kernel's substitution and output read.

    - G for the whole chunk (the prep's dot); A's rows of t's ROWS-row block (K K^T rows by the prep's dots, A's
      elementwise formula) into this program's scratch ``a_ptr`` (ROWS x C): the row kernel reads row t's blocks.
    - Row t of X_bb (T^{-1}'s diagonal block holding t) by the prep's fma chain over the block's rows before t, read
      from the state cache (``bt_ptr``: buf_tinv, [slots, Hv, C, C]), and stored there; only the block's IB columns
      (the substitution reads no other).
    - Row t of the output's P (:func:`output_p` at the output's precision OPREC, the chunk's k already in registers)
      into ``p_ptr`` (ROWS x C per program), so that the row kernel reads no k tile.
    - KD and e^{G_C} at the chunk's close.

    Every dot is the prep's with the same K extent and order; a row's bits depend on nothing but that row and the
    other operand (on the GPU, at the chunk form's precisions), so row t is the training tile's. ROWS:
    ``DECODE_ROWS`` (the IB-row block on the GPU; the whole chunk under the interpreter, whose numpy dot bits follow
    the tile's row count and position).
    """
    hk = h // REP
    row0, nbuf, brow0, nrows = chunk_row(chunk_ptr, sid)
    t = nrows - 1
    ib = t // IB
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    os3 = tl.arange(0, IB)
    r0 = (t // ROWS) * ROWS
    orr = r0 + tl.arange(0, ROWS)
    mine = orr == t
    # The token into the buffer first, while no tile is live (chunk row flag: the call leaves its chunk open). No
    # program reads buffer row t: every kernel of this step reads the token from the packed rows. (A masked ROWS-row
    # tile: as a one-row tile, tl.arange(0, 1), the prep is slower.)
    buffer_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, orr,
                 mine & (tl.load(chunk_ptr + sid * 5 + 4) == 1), row0, brow0, SK, SV, SG, SB, HK, HV, DK, DV, REP, h,
                 BK, BVF)  # fmt: skip
    in_buf = ot < nbuf
    present = ot < nrows
    _, cum = chunk_gates(g_ptr, b_ptr, bg_ptr, bb_ptr, row0 + ot, brow0 + ot, in_buf, present, SG, SB, HV, h, C)
    # q before the first store of G: a load after a store that may alias it stays after it, and loaded where P's dot
    # needs it (after A's store) it added a dependent memory round trip to the step
    q = _token_tile(q_ptr + (row0 + t) * SQ + hk * DK, ok, DK, mine)
    base = sid * HV + h
    tl.store(gcum_ptr + base * C + ot, cum)
    tbase = bt_ptr + ((brow0 // C) * HV + h) * C * C  # this slot's T^{-1} rows
    abase = a_ptr + base * ROWS * C  # A's rows orr
    kbuf, ktok = bk_ptr + (brow0 * HK + hk) * DK, k_ptr + (row0 + t) * SK + hk * DK
    kcf = _decode_tile(kbuf, ktok, ot, ok, t, HK * DK, DK)
    if ROWS == C:  # noqa: SIM108  (a constexpr branch: no second load at all)
        krow = kcf
    else:
        krow = _decode_tile(kbuf, ktok, orr, ok, t, HK * DK, DK)
    kk = kk_rows(k_ptr, bk_ptr, orr, kcf, krow, kd_ptr, base, cum, row0, brow0, nbuf, nrows, SK, HK, DK, hk,
                  C, BK, KB, PREC, ROWS, False)  # fmt: skip
    tl.debug_barrier()  # G's rows stored by other threads are read below
    bcr = beta_rows(b_ptr, bb_ptr, orr, row0, brow0, nbuf, nrows, SB, HV, h)
    cur = tl.load(gcum_ptr + base * C + orr)
    lower = orr[:, None] > ot[None, :]
    a = tl.where(lower, bcr[:, None] * tl.exp(tl.where(lower, cur[:, None] - cum[None, :], 0.0)) * kk, 0.0)
    tl.store(abase + tl.arange(0, ROWS)[:, None] * C + ot[None, :], a)
    p = output_p(q.to(tl.float32) * scale, kcf, cur, cum, orr[:, None] >= ot[None, :], OPREC)
    tl.store(p_ptr + (base * ROWS + tl.arange(0, ROWS))[:, None] * C + ot[None, :], p, mask=mine[:, None])
    tl.debug_barrier()
    # Row t of X_bb: x_t = e_t - sum_{r<s} A_tr x_r over the block's rows r before t (s = t - ib IB), on the block's
    # columns. Unrolled over the IB - 1 rows a block can have before t, the rows r >= s masked and passed over by a
    # select: the prep's fmas, in its order, with every load issued at once (a run-time loop made one dependent round
    # trip per row).
    arow = abase + (t - r0) * C
    cols = ib * IB + os3
    acc = tl.zeros([IB], dtype=tl.float32)
    for r in tl.static_range(IB - 1):
        live = r < t - ib * IB
        x_r = tl.load(tbase + (ib * IB + r) * C + cols, mask=live & (os3 < IB), other=0.0)
        acc = tl.where(live, tl.fma(tl.load(arow + ib * IB + r, mask=live, other=0.0), x_r, acc), acc)
    tl.store(tbase + t * C + cols, tl.where(cols == t, 1.0, 0.0) - acc)
    if nrows == C:  # the chunk closes: KD and e^{G_C} for the decode row kernel's exit state
        gl = tl.sum(tl.where(ot == C - 1, cum, 0.0), axis=0)
        # k reloaded (one step in C closes a chunk), so that the k tile is dead after P's dot
        kcl = _decode_tile(kbuf, ktok, ot, ok, t, HK * DK, DK)
        tl.store((kd_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :],
                 (tl.exp(gl - cum)[:, None] * kcl).to(kd_ptr.dtype.element_ty))  # fmt: skip
        tl.store(egc_ptr + base, tl.exp(gl))


@triton.jit
def _decode_row_block(
    q_ptr, k_ptr, v_ptr, b_ptr, chunk_ptr, chain_ptr, entry_ptr, entry_bf16_ptr, kd_ptr, egc_ptr, gcum_ptr, p_ptr,
    a_ptr, bt_ptr, bu_ptr, by_ptr, o_ptr,
    scale, SQ, SK, SV, SB, HV, DK, DV, REP,
    sid, h, vb,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IB: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr,
    SUM_ONE_DOT: tl.constexpr,
):  # fmt: skip
    """Chunk form, a call of one token per sequence (a decode step) at chunk position t: for sequence ``sid``, value
    head ``h`` and Dv block ``vb``, the token's rows of what training computes as tiles, from ``_decode_prep_kernel``'s
    A, X_bb and P rows and the state cache:

    - the substitution's row t (the chain's block b = t // IB): ``Y_t = R_t - sum_{j<b} A_tj u_j`` (:func:`subst_y`,
      R's operands from the token's row (:func:`subst_operands`), u's earlier blocks from ``buf_u``; with bf16 dots E
      from ``entry_bf16``), stored into ``buf_y``, then
      ``u_t = X_bb[t] Y_b`` with Y's earlier rows of the block from ``buf_y``, stored into ``buf_u``;
    - ``o_t = e^{G_t} (q_t E) + P_t u`` (the output kernel's), with u's earlier rows from ``buf_u``;
    - when t closes the chunk, ``E' = e^{G_C} E + sum_b KD_b^T u_b`` (the chain's) into ``entry``.

    Every dot has the training dot's K extent and order and, for the substitution's, its IB-row tile with row t in
    its place; only the other rows differ (zeros or other values), which moves no bit of row t on the GPU at the chunk
    form's precisions. Chunk and chain rows are the plan's (one each per sequence)."""
    hk = h // REP
    row0, _, brow0, nrows = chunk_row(chunk_ptr, sid)
    ekind = tl.load(chain_ptr + sid * 6 + 2)
    erow = tl.load(chain_ptr + sid * 6 + 3).to(tl.int64)
    closes = tl.load(chain_ptr + sid * 6 + 5) == 0
    t = nrows - 1
    r0 = (t // ROWS) * ROWS
    orr = r0 + tl.arange(0, ROWS)
    mine = orr == t
    oi = tl.arange(0, IB)
    orb = (t // IB) * IB + oi  # the substitution block holding t
    mineb = orb == t
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    st = (h * DK + ok[:, None]) * DV + ov[None, :]
    hsz = HV * DK * DV
    base = sid * HV + h
    if PREC == "bf16":  # E as the dots round it, stored so at the chunk's close: the same bits from half the bytes
        e = tl.load(entry_bf16_ptr + erow * hsz + st, mask=m2 & (ekind == 1), other=0.0)
    else:
        e = tl.load(entry_ptr + erow * hsz + st, mask=m2 & (ekind == 1), other=0.0)
    bu_rows = (bu_ptr + (brow0 * HV + h) * DV) + ov[None, :]  # + row * (HV * DV): this slot's buf_u
    by_rows = (by_ptr + (brow0 * HV + h) * DV) + ov[None, :]
    u_prev = tl.load(bu_rows + ot[:, None] * (HV * DV), mask=(ot < t)[:, None] & mv[None, :], other=0.0).to(tl.float32)
    # Every operand this program does not write is loaded here, before its first store: the compiler keeps a load
    # after a store that may alias it, so loaded later each one added a dependent memory round trip to the step.
    # Y's rows of t's block before t (earlier steps' or the chain's), X_bb's row t and P's row t (the decode prep's),
    # G's rows of the output tile.
    y_prev = tl.load(by_rows + orb[:, None] * (HV * DV), mask=(orb < t)[:, None] & mv[None, :], other=0.0)
    xrow = _token_tile(bt_ptr + (((brow0 // C) * HV + h) * C + t) * C + (t // IB) * IB, oi, IB, mineb)
    p = _token_tile(p_ptr + (base * ROWS + t - r0) * C, ot, C, mine)
    g_out = tl.load(gcum_ptr + base * C + orr)
    q = _token_tile(q_ptr + (row0 + t) * SQ + hk * DK, ok, DK, mine).to(tl.float32) * scale
    qe = dot(q, e, None, PREC)
    # Y_t: the earlier blocks' A_tj u_j (the chain's dots in its IB-row tiles), then R_t, in the chain's order
    arow = a_ptr + (base * ROWS + t - r0) * C
    if SUM_ONE_DOT:  # one dot over the chunk, A's columns from t's block on zero (DECODE_SUM_ONE_DOT)
        acc = dot(tl.where((ot < (t // IB) * IB)[None, :], _token_tile(arow, ot, C, mineb), 0.0), u_prev, None, PREC)
    else:
        acc = tl.zeros([IB, BV], dtype=tl.float32)
        for jb in range(t // IB):
            uj = tl.load(bu_rows + (jb * IB + oi)[:, None] * (HV * DV), mask=mv[None, :], other=0.0)
            acc = dot(_token_tile(arow + jb * IB, oi, IB, mineb), uj, acc, PREC)
    tok = row0 + t
    bv, kp = subst_operands(
        tl.where(mineb, tl.load(b_ptr + tok * SB + h).to(tl.float32), 0.0),
        tl.load(gcum_ptr + base * C + orb),
        _token_tile(k_ptr + tok * SK + hk * DK, ok, DK, mineb).to(tl.float32),
        _token_tile(v_ptr + tok * SV + h * DV, ov, DV, mineb).to(tl.float32),
    )
    y = subst_y(bv, kp, e, acc, PREC)
    tl.store(by_rows + orb[:, None] * (HV * DV), y.to(by_ptr.dtype.element_ty), mask=mineb[:, None] & mv[None, :])
    # u_t = X_bb[t] Y_b: Y's rows before t from buf_y, row t from registers (the value buf_y now holds, as a dot
    # rounds it); X_bb's row t as the decode prep stored it in buf_tinv
    yb = tl.where(mineb[:, None], y, y_prev.to(tl.float32))
    u = dot(xrow, yb, None, PREC)
    tl.store(bu_rows + orb[:, None] * (HV * DV), u.to(bu_ptr.dtype.element_ty), mask=mineb[:, None] & mv[None, :])
    # u's rows as the output dot reads them: rows < t from buf_u (loaded above), row t from registers, exactly the
    # value buf_u now holds (as stored, then widened). The row is picked out of u's IB rows by a sum whose other
    # terms are -0.0, the identity of + (x + -0 == x for every x, +0 and -0 included), so no bit moves.
    u_t = tl.sum(tl.where(mineb[:, None], u, -0.0), axis=0).to(bu_ptr.dtype.element_ty).to(tl.float32)
    u_all = tl.where((ot == t)[:, None], u_t[None, :], u_prev)
    o = output_rows_from(qe, u_all, p, g_out, PREC)
    tl.store(
        (o_ptr + (row0 * HV + h) * DV) + orr[:, None] * (HV * DV) + ov[None, :], o, mask=mine[:, None] & mv[None, :]
    )
    if closes:  # the chain's exit state of the chunk, from the u rows, block by block as the chain adds them
        # E again from memory (unchanged since the load above): the output's E tile is dead by now, so the exit
        # state's accumulator does not share the registers with it
        ec = tl.load(entry_ptr + erow * hsz + st, mask=m2 & (ekind == 1), other=0.0) * tl.load(egc_ptr + base)
        for b in tl.static_range(C // IB):
            rb = b * IB + oi
            ub = tl.load(bu_rows + rb[:, None] * (HV * DV), mask=(rb < t)[:, None] & mv[None, :], other=0.0)
            ub = tl.where((rb == t)[:, None], u_t[None, :], ub.to(tl.float32))
            kd = tl.load((kd_ptr + base * C * BK) + rb[:, None] * BK + ok[None, :])
            ec = dot(tl.trans(kd), ub, ec, PREC)
        tl.store(entry_ptr + erow * hsz + st, ec, mask=m2)
        tl.store(entry_bf16_ptr + erow * hsz + st, ec.to(tl.bfloat16), mask=m2)
    else:  # a fresh sequence's open chunk keeps a zero entry state for the next step
        tl.store(entry_ptr + erow * hsz + st, tl.zeros([BK, BV], dtype=tl.float32), mask=m2 & (ekind == 0))
        tl.store(entry_bf16_ptr + erow * hsz + st, tl.zeros([BK, BV], dtype=tl.bfloat16), mask=m2 & (ekind == 0))


@triton.jit
def _decode_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, bt_ptr, chunk_ptr,
    kd_ptr, egc_ptr, gcum_ptr, p_ptr, a_ptr,
    scale, SQ, SK, SV, SG, SB, HK, HV, DK: tl.constexpr, DV: tl.constexpr, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr, PREC: tl.constexpr,
    OPREC: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """:func:`_decode_prep_rows` per (sequence, value head): a decode step's first kernel (its second:
    ``_decode_row_kernel``)."""
    _decode_prep_rows(
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, bt_ptr, chunk_ptr, kd_ptr, egc_ptr,
        gcum_ptr, p_ptr, a_ptr, scale, SQ, SK, SV, SG, SB, HK, HV, DK, DV, REP,
        tl.program_id(0).to(tl.int64), tl.program_id(1), C, BK, BVF, KB, IB, PREC, OPREC, ROWS,
    )  # fmt: skip


@triton.jit
def _decode_row_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, chunk_ptr, chain_ptr, entry_ptr, entry_bf16_ptr, kd_ptr, egc_ptr, gcum_ptr, p_ptr,
    a_ptr, bt_ptr, bu_ptr, by_ptr, o_ptr,
    scale, SQ, SK, SV, SB, HV, DK: tl.constexpr, DV: tl.constexpr, REP,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IB: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr,
    SUM_ONE_DOT: tl.constexpr,
):  # fmt: skip
    """:func:`_decode_row_block` per (sequence, value head, Dv block): a decode step's second kernel. DK and DV are
    constexprs, as in ``_decode_prep_kernel``: the column masks fold away where they equal the blocks (fewer
    instructions, and no spills at chunk:bf16; one compile per head size, which a model has one of)."""
    _decode_row_block(
        q_ptr, k_ptr, v_ptr, b_ptr, chunk_ptr, chain_ptr, entry_ptr, entry_bf16_ptr, kd_ptr, egc_ptr, gcum_ptr, p_ptr,
        a_ptr, bt_ptr, bu_ptr, by_ptr, o_ptr, scale, SQ, SK, SV, SB, HV, DK, DV, REP,
        tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), C, BK, BV, IB, ROWS, PREC, SUM_ONE_DOT,
    )  # fmt: skip


def decode_rows(chunk: int) -> int:
    """The row count of a chunk-form decode step's tiles (``DECODE_ROWS``; its 0 means the whole chunk)."""
    return min(tuning.DECODE_ROWS or chunk, chunk)


def decode_step(
    q: tuple[torch.Tensor, int],
    rows: tuple,
    buffers: tuple[torch.Tensor, ...],
    state: GDNLayerState,
    plan: Plan,
    entries: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    cfg: GDNConfig,
    scale: float,
) -> None:
    """A chunk-form decode step (one token per sequence, ``plan``'s chunk and chain rows one per sequence) into
    ``out``: ``_decode_prep_kernel`` (A's rows of each token's ``DECODE_ROWS`` rows, the output's P row, KD and
    e^{G_C} where it closes its chunk, G (:func:`prep_outputs`); the token's X_bb row into ``state.buf_tinv``), then
    ``_decode_row_kernel`` (Y and u rows into ``state.buf_y`` and ``state.buf_u``, o, the exit state at a close).
    ``q``, ``rows``: as :func:`.rule._rows` returns them."""
    qf, sq = q
    (kf, sk), (vf, sv), (gf, sg), (bf, sb) = rows
    hk, dk = kf.shape[1:]
    hv, dv = vf.shape[1:]
    n, c, dev = plan.n, cfg.chunk, kf.device
    nrows = decode_rows(c)
    _, _, kd, egc, gcum = prep_outputs(n, hv, cfg, dev, wy=False)
    p = torch.empty(n, hv, nrows, c, dtype=torch.float32, device=dev)  # the output's P rows
    a = torch.empty_like(p)  # A's rows, read by the row kernel
    sizes = (hv, dk, dv, hv // hk)
    _decode_prep_kernel[(n, hv)](
        qf, kf, vf, gf, bf, *buffers, state.buf_tinv, plan.chunks, kd, egc, gcum, p, a, scale, sq, sk, sv, sg, sb, hk,
        *sizes, C=c, BK=cfg.bk, BVF=cfg.bv_full, KB=cfg.kb, IB=cfg.inv_block, PREC=cfg.prep_precision,
        OPREC=cfg.chain_precision, ROWS=nrows, num_warps=tuning.DECODE_PREP_WARPS, num_stages=tuning.PREP_STAGES,
        **maxnreg(tuning.DECODE_PREP_MAXNREG), **fp_options(cfg.form),
    )  # fmt: skip
    _decode_row_kernel[(n, hv, triton.cdiv(dv, cfg.decode_bv))](
        qf, kf, vf, bf, plan.chunks, plan.chains, *entries, kd, egc, gcum, p, a, state.buf_tinv, state.buf_u,
        state.buf_y, out, scale, sq, sk, sv, sb, *sizes, C=c, BK=cfg.bk, BV=cfg.decode_bv, IB=cfg.inv_block,
        ROWS=nrows, PREC=cfg.chain_precision, SUM_ONE_DOT=tuning.DECODE_SUM_ONE_DOT and cfg.chain_precision != "ieee",
        num_warps=tuning.DECODE_WARPS,
        **maxnreg(tuning.DECODE_MAXNREG), **fp_options(cfg.form),
    )  # fmt: skip
