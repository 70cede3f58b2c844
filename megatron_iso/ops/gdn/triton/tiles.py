"""The small ``@triton.jit`` helpers the kernels share: chunk tiles read from the state cache's buffer or the packed
rows, a plan's chunk row, a chunk's gates, rows of K K^T, the substitution's and the chunk-form output's arithmetic.

Training tiles and a decode step's rows go through the same helper wherever they compute the same quantity, so both
run one arithmetic (docs/GDN.md, "Decode").
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_iso.ops.gdn.triton.tuning import dot


@triton.jit
def _buffered_or_packed(buf_ptrs, packed_ptrs, from_buf, mask):
    """A chunk tile of the prep kernel: where ``from_buf``, the state cache's buffer; elsewhere the call's packed rows;
    both widened exactly to fp32. Both sources hold the same values, so either gives the same chunk."""
    return tl.where(
        from_buf,
        tl.load(buf_ptrs, mask=from_buf & mask, other=0.0).to(tl.float32),
        tl.load(packed_ptrs, mask=(~from_buf) & mask, other=0.0).to(tl.float32),
    )


@triton.jit
def k_tile(k_ptr, bk_ptr, tok, cols, row0, brow0, nbuf, nrows, SK, HK, DK, hk):
    """k of key head ``hk`` at chunk tokens ``tok`` and key columns ``cols``: tokens < ``nbuf`` from the state cache's
    buffer, the others from the packed rows, tokens >= ``nrows`` and columns >= DK as zeros (every kernel that reads a
    chunk's k reads it through here, so each sees the same tile)."""
    return _buffered_or_packed(
        (bk_ptr + (brow0 * HK + hk) * DK) + tok[:, None] * (HK * DK) + cols[None, :],
        (k_ptr + row0 * SK + hk * DK) + tok[:, None] * SK + cols[None, :],
        (tok < nbuf)[:, None],
        (cols < DK)[None, :] & (tok < nrows)[:, None],
    )


@triton.jit
def v_tile(v_ptr, bvv_ptr, tok, cols, row0, brow0, nbuf, nrows, SV, HV, DV, h):
    """v of value head ``h`` at chunk tokens ``tok`` and value columns ``cols``, as :func:`k_tile` reads k: tokens <
    ``nbuf`` from the state cache's buffer, the others from the packed rows, tokens >= ``nrows`` and columns >= DV as
    zeros."""
    return _buffered_or_packed(
        (bvv_ptr + (brow0 * HV + h) * DV) + tok[:, None] * (HV * DV) + cols[None, :],
        (v_ptr + row0 * SV + h * DV) + tok[:, None] * SV + cols[None, :],
        (tok < nbuf)[:, None],
        (cols < DV)[None, :] & (tok < nrows)[:, None],
    )


@triton.jit
def beta_rows(b_ptr, bb_ptr, tok, row0, brow0, nbuf, nrows, SB, HV, h):
    """beta of value head ``h`` at chunk tokens ``tok``, as :func:`v_tile` reads v: tokens < ``nbuf`` from the state
    cache's buffer, the others from the packed rows, tokens >= ``nrows`` as zeros."""
    return _buffered_or_packed(bb_ptr + (brow0 + tok) * HV + h, b_ptr + (row0 + tok) * SB + h, tok < nbuf, tok < nrows)


@triton.jit
def chunk_row(chunk_ptr, cid):
    """A plan's chunk row (_prep_kernel's docstring): packed row of token 0, buffered tokens, buffer row base,
    tokens present."""
    row = chunk_ptr + cid * 5
    return tl.load(row).to(tl.int64), tl.load(row + 1), tl.load(row + 2).to(tl.int64), tl.load(row + 3)


@triton.jit
def chunk_gates(g_ptr, b_ptr, bg_ptr, bb_ptr, rows, brows, in_buf, present, SG, SB, HV, h, C: tl.constexpr):
    """beta and G = cumsum(g) of a chunk's rows (tokens in the buffer or packed, absent ones zero). G as an ieee dot
    with the lower-triangular ones (one fma chain per row, i ascending: a row's value depends on nothing but
    g_0..g_t, whatever the tile), not tl.cumsum, whose association follows the layout."""
    ot = tl.arange(0, C)
    gc = _buffered_or_packed(bg_ptr + brows * HV + h, g_ptr + rows * SG + h, in_buf, present)
    bc = _buffered_or_packed(bb_ptr + brows * HV + h, b_ptr + rows * SB + h, in_buf, present)
    o16 = tl.arange(0, 16)
    lower_eq = tl.where(ot[:, None] >= ot[None, :], 1.0, 0.0)
    g16 = tl.where(o16[None, :] == 0, gc[:, None], 0.0)
    cum = tl.sum(tl.where(o16[None, :] == 0, tl.dot(lower_eq, g16, input_precision="ieee"), 0.0), axis=1)
    return bc, cum


@triton.jit
def kk_rows(k_ptr, bk_ptr, orr, kcf, krow, kd_ptr, base, dkd, row0, brow0, nbuf, nrows, SK, HK, DK, hk,
             C: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr, ROWS: tl.constexpr,
             STORE_KD: tl.constexpr):  # fmt: skip
    """Rows ``orr`` (ROWS of them) of K K^T: K-blocked over the key columns (ieee: KB at a time, ascending) or one
    whole-K dot of ``krow`` (k's rows orr) with ``kcf`` (tensor cores: the chunk's k tile; both loaded by the caller;
    with ROWS == C krow must be kcf itself: the interpreter's numpy computes ``x @ x.T`` of one array by another
    routine than of two, so a decode step under the interpreter must pass it as the prep does). STORE_KD (the prep,
    ROWS == C): also KD = e^{G_C-G} k (``dkd`` = e^{G_C-G}) into this (chunk, head)'s KD rows on the way, block by
    block."""
    ot = tl.arange(0, C)
    if PREC == "ieee":
        ob = tl.arange(0, KB)
        kk = tl.zeros([ROWS, C], dtype=tl.float32)
        for kb in range(BK // KB):
            okb = kb * KB + ob
            kcb = k_tile(k_ptr, bk_ptr, ot, okb, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
            if ROWS == C:  # noqa: SIM108  (a constexpr branch: no second load at all)
                krb = kcb
            else:
                krb = k_tile(k_ptr, bk_ptr, orr, okb, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
            kk = dot(krb, tl.trans(kcb), kk, PREC)
            if STORE_KD:
                tl.store((kd_ptr + base * C * BK) + ot[:, None] * BK + okb[None, :],
                         (dkd[:, None] * kcb).to(kd_ptr.dtype.element_ty))  # fmt: skip
    else:
        kk = dot(krow, tl.trans(kcf), None, PREC)
        if STORE_KD:
            tl.store((kd_ptr + base * C * BK) + ot[:, None] * BK + tl.arange(0, BK)[None, :],
                     (dkd[:, None] * kcf).to(kd_ptr.dtype.element_ty))  # fmt: skip
    return kk


@triton.jit
def subst_operands(bcb, cumb, kb, vb):
    """``beta v`` and ``beta e^G k`` of some rows (``bcb``, ``cumb``: their beta and G; ``kb``, ``vb``: their k and v
    columns), the operands of :func:`subst_y`: the one elementwise arithmetic of the prep's chunk rows and of a
    decode step's token row."""
    return bcb[:, None] * vb, (bcb * tl.exp(cumb))[:, None] * kb


@triton.jit
def subst_y(bv, kp, e, acc, PREC: tl.constexpr):
    """Rows of ``Y = R - acc`` with ``R = beta v - (beta e^G k) E``, the block forward substitution's right-hand side
    (docs/GDN.md, "Substitution"): ``bv``, ``kp`` the rows' :func:`subst_operands`, ``acc`` the sum of
    ``A_bj u_j`` over the earlier blocks j. The one arithmetic of the chain's block tiles and of a decode step's row."""
    return (bv - dot(kp, e, None, PREC)) - acc


@triton.jit
def output_p(q, k, g_rows, g_all, causal, PREC: tl.constexpr):
    """``P[t, i] = e^{G_t - G_i} (q_t . k_i)`` for i <= t (``causal``), 0 above: the intra-chunk weights of the
    chunk-form output rows (:func:`output_rows`), in the training tile and in a decode step's prep."""
    qk = dot(q, tl.trans(k), None, PREC)
    return tl.where(causal, qk * tl.exp(tl.where(causal, g_rows[:, None] - g_all[None, :], 0.0)), 0.0)


@triton.jit
def output_rows(q, e, u, p, g_rows, PREC: tl.constexpr):
    """Chunk-form output rows ``e^{G_t} (q_t E) + P u`` (P: :func:`output_p`): the one arithmetic of the training tile
    (``_chunk_out_kernel``) and of a decode step's rows (``_decode_row_kernel``, which computes ``q_t E`` early:
    :func:`output_rows_from`)."""
    return output_rows_from(dot(q, e, None, PREC), u, p, g_rows, PREC)


@triton.jit
def output_rows_from(qe, u, p, g_rows, PREC: tl.constexpr):
    """:func:`output_rows` from its ``q E`` dot (``qe``), computed by the caller."""
    return dot(p, u, qe * tl.exp(g_rows)[:, None], PREC)


@triton.jit
def buffer_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, tok, new, row0, brow0,
                 SK, SV, SG, SB, HK, HV, DK, DV, REP, h, BK: tl.constexpr, BVF: tl.constexpr):  # fmt: skip
    """Chunk tokens ``tok`` where ``new``: their packed k, v, g, beta as fp32 into the state cache's buffer rows
    (k by the first value head of each key head)."""
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BVF)
    rows = row0 + tok
    br = brow0 + tok
    hk = h // REP
    mv2 = new[:, None] & (ov < DV)[None, :]
    v = tl.load((v_ptr + row0 * SV + h * DV) + tok[:, None] * SV + ov[None, :], mask=mv2)
    tl.store(
        (bv_ptr + (brow0 * HV + h) * DV) + tok[:, None] * (HV * DV) + ov[None, :],
        v.to(bv_ptr.dtype.element_ty),
        mask=mv2,
    )
    tl.store(bg_ptr + br * HV + h, tl.load(g_ptr + rows * SG + h, mask=new).to(tl.float32), mask=new)
    tl.store(bb_ptr + br * HV + h, tl.load(b_ptr + rows * SB + h, mask=new).to(tl.float32), mask=new)
    mk2 = new[:, None] & (ok < DK)[None, :] & (h % REP == 0)
    kt = tl.load((k_ptr + row0 * SK + hk * DK) + tok[:, None] * SK + ok[None, :], mask=mk2)
    tl.store((bk_ptr + (brow0 * HK + hk) * DK) + tok[:, None] * (HK * DK) + ok[None, :], kt.to(tl.float32), mask=mk2)
