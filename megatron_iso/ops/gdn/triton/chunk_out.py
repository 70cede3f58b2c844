"""The chunk form's output tiles (``O = e^G (Q E) + P u`` per chunk) and the copy of a chunk a call leaves open into
the state cache (docs/GDN.md, "Chunk form")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.gdn.state_cache import GDNLayerState
from megatron_iso.ops.gdn.triton import tuning
from megatron_iso.ops.gdn.triton.plan import Plan
from megatron_iso.ops.gdn.triton.tiles import buffer_rows, chunk_row, k_tile, output_p, output_rows
from megatron_iso.ops.gdn.triton.tuning import GDNConfig, fp_options, maxnreg


@triton.jit
def _chunk_out_kernel(
    q_ptr, k_ptr, bk_ptr, chunk_ptr, en_ptr, u_ptr, gcum_ptr, o_ptr,
    scale, SQ, SK, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Chunk-form outputs of one (chunk, value head, Dv block): ``O = e^G (Q E) + P u`` with
    ``P[t, i] = e^{G_t - G_i} (q_t . k_i)`` for i <= t (0 above), E the chunk's entry state (the chain's ``ex`` row),
    u the chain's (``u_ptr``), G the prep kernel's cumulative decay. Rows ``buffered..nrows-1`` are
    this call's tokens and are stored; a buffered row's q is not kept and loads as zero (its output was written by the
    call that brought it). Each output row is a function of its own q row, of the rows <= it of k, G and u, and of E:
    a decode step's tile (later rows zero) gives the training tile's bits (docs/GDN.md, "Chunk form").
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // REP
    row0, nbuf, brow0, nrows = chunk_row(chunk_ptr, cid)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    present = ot < nrows
    new = present & (ot >= nbuf)
    base = cid * HV + h
    q = tl.load((q_ptr + row0 * SQ + hk * DK) + ot[:, None] * SQ + ok[None, :], mask=new[:, None] & mk[None, :],
                other=0.0)  # fmt: skip
    q = q.to(tl.float32) * scale
    k = k_tile(k_ptr, bk_ptr, ot, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
    gc = tl.load(gcum_ptr + base * C + ot)
    e = tl.load(en_ptr + cid * HV * DK * DV + (h * DK + ok[:, None]) * DV + ov[None, :],
                mask=mk[:, None] & mv[None, :], other=0.0)  # fmt: skip
    u = tl.load((u_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], mask=mv[None, :], other=0.0)
    p = output_p(q, k, gc, gc, ot[:, None] >= ot[None, :], PREC)
    o = output_rows(q, e, u, p, gc, PREC)
    tl.store((o_ptr + (row0 * HV + h) * DV) + ot[:, None] * (HV * DV) + ov[None, :], o, mask=new[:, None] & mv[None, :])


@triton.jit
def _buffer_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, chunk_ptr, u_ptr, bu_ptr, tinv_ptr, bt_ptr,
    SK, SV, SG, SB, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
):  # fmt: skip
    """Chunk form, a call that is not a decode step: the tokens of a chunk it leaves open (chunk row flag, column 4)
    into the state cache's ``buf_*`` rows, after every kernel that reads the buffer (a call that closes a chunk
    and opens the next reuses the slot's rows), with their u rows (the chain's ``u_ptr``) into ``buf_u`` and their
    T^{-1} rows (the prep's ``tinv_ptr``) into ``buf_tinv``, for the decode steps that follow (a decode step stores
    its own, in ``_decode_prep_kernel`` and ``_decode_row_kernel``)."""
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row0, nbuf, brow0, nrows = chunk_row(chunk_ptr, cid)
    wflag = tl.load(chunk_ptr + cid * 5 + 4)
    ot = tl.arange(0, C)
    ov = tl.arange(0, BVF)
    new = (ot >= nbuf) & (ot < nrows) & (wflag == 1)
    buffer_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, ot, new, row0, brow0,
                 SK, SV, SG, SB, HK, HV, DK, DV, REP, h, BK, BVF)  # fmt: skip
    mu = new[:, None] & (ov < DV)[None, :]
    u = tl.load(u_ptr + ((cid * HV + h) * C + ot[:, None]) * BVF + ov[None, :], mask=mu)
    tl.store(
        (bu_ptr + (brow0 * HV + h) * DV) + ot[:, None] * (HV * DV) + ov[None, :], u.to(bu_ptr.dtype.element_ty), mask=mu
    )
    tile = ot[:, None] * C + ot[None, :]
    ti = tl.load(tinv_ptr + (cid * HV + h) * C * C + tile, mask=new[:, None])
    tl.store(bt_ptr + ((brow0 // C) * HV + h) * C * C + tile, ti, mask=new[:, None])


def chunk_outputs(
    q: tuple[torch.Tensor, int],
    k: tuple[torch.Tensor, int],
    buf_k: torch.Tensor,
    plan: Plan,
    ex: torch.Tensor,
    u: torch.Tensor,
    gcum: torch.Tensor,
    out: torch.Tensor,
    cfg: GDNConfig,
    scale: float,
) -> None:
    """``_chunk_out_kernel`` per (chunk, value head, Dv block) of ``plan`` into ``out`` ``[T, Hv, Dv]``: each chunk's
    output tile from its entry state (``ex``), u and G (the state pass's). ``q``, ``k``: as the rule's ``_rows``
    returns them (tensor, row stride); ``buf_k``: the state cache's (buffered tokens' k)."""
    (qf, sq), (kf, sk) = q, k
    hk, dk = kf.shape[1:]
    hv, dv = out.shape[1:]
    _chunk_out_kernel[(plan.nchunks, hv, triton.cdiv(dv, cfg.out_bv))](
        qf, kf, buf_k, plan.chunks, ex, u, gcum, out, scale, sq, sk, hk, hv, dk, dv, hv // hk,
        C=cfg.chunk, BK=cfg.bk, BVF=cfg.bv_full, BV=cfg.out_bv, PREC=cfg.chain_precision,
        num_warps=tuning.OUT_WARPS, **maxnreg(tuning.OUT_MAXNREG), **fp_options(cfg.form),
    )  # fmt: skip


def buffer_open_chunks(
    rows: tuple,
    buffers: tuple[torch.Tensor, ...],
    plan: Plan,
    u: torch.Tensor,
    tinv: torch.Tensor,
    state: GDNLayerState,
    cfg: GDNConfig,
) -> None:
    """``_buffer_kernel`` per (chunk, value head) of ``plan``: the tokens of each chunk the call leaves open into
    ``buffers`` (the state cache's buf_k, buf_v, buf_g, buf_beta), their u rows into ``state.buf_u`` and their
    T^{-1} rows (``tinv``, the prep's) into ``state.buf_tinv``. ``rows``: k, v, g, beta as the rule's ``_rows``
    returns them."""
    (kf, sk), (vf, sv), (gf, sg), (bf, sb) = rows
    hk, dk = kf.shape[1:]
    hv, dv = vf.shape[1:]
    _buffer_kernel[(plan.nchunks, hv)](
        kf, vf, gf, bf, *buffers, plan.chunks, u, state.buf_u, tinv, state.buf_tinv, sk, sv, sg, sb,
        hk, hv, dk, dv, hv // hk, C=cfg.chunk, BK=cfg.bk, BVF=cfg.bv_full,
    )  # fmt: skip
