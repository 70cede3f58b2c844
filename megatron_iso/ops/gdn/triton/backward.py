"""Gated DeltaNet training backward in Triton: deterministic chunk kernels (no atomics, fixed-order dots and sums).

Four kernels (local, chain, output, WY) over the forward's chunk-form state pass, dots at the forward chain's
precision; the readable reference is :class:`megatron_iso.ops.gdn.native._ChunkRule`'s backward. Deterministic, not
invariant (the policy asks no more of a backward). Training calls only.

Design and the per-kernel algebra: docs/GDN.md, "Backward kernels".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.gdn.triton.tiles import chunk_row
from megatron_iso.ops.gdn.triton.tuning import INTERPRET, MIN_DOT, dot, maxnreg

# Tuning. The chain's Dv block: 64 with bf16 operands (faster than 32), 32 with fp32 ones (64 needs more shared
# memory than sm_90 has at tf32). The output and WY kernels loop over Dv blocks of BWD_BV and key slices of BWD_KS
# (on sm_90a slices of 32 spill nothing); 4 warps (faster than 8).
BWD_CHAIN_BV_BF16 = 4 if INTERPRET else 64
BWD_CHAIN_BV = 4 if INTERPRET else 32
BWD_BV = 4 if INTERPRET else 32
BWD_KS = 4 if INTERPRET else 32
BWD_WARPS = 4
BWD_CHAIN_WARPS = 4
# Software-pipelining depth of the chain's loop over chunks (it only moves loads). 1: 48 KB of shared memory, so two
# programs fit on an SM; Triton's default 3 takes 144 KB, one program per SM, and is slower (so is 2)
BWD_CHAIN_STAGES = 1
# Register caps (as config's *_MAXNREG): the local, output and WY kernels, and the chain; 0 = ptxas' choice
BWD_MAXNREG, BWD_CHAIN_MAXNREG = 0, 0


@triton.jit
def _row_tile(ptr, rows, present, stride, col0, cols, ncols):
    """``[rows, cols]`` of a packed tensor (row stride ``stride``, columns from ``col0``), widened to fp32; rows not
    ``present`` and columns >= ``ncols`` as zeros."""
    mask = present[:, None] & (cols < ncols)[None, :]
    return tl.load(ptr + rows[:, None] * stride + col0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _key_grad_rows(ptr, rows, cols, h, hk, NT, HK, DK, REP):
    """Addresses of dq or dk at packed ``rows`` and key columns ``cols`` of value head h: plane ``h % REP`` of a
    ``[REP, NT, HK, DK]`` tensor, so that the planes of a key head's value heads are whole contiguous tensors for
    :func:`key_head_sum` to add."""
    return ptr + (((h % REP) * NT + rows[:, None]) * HK + hk) * DK + cols[None, :]


@triton.jit
def _bwd_local_kernel(
    q_ptr, k_ptr, do_ptr, chunk_ptr, gcum_ptr, dvl_ptr,
    scale, SQ, SK, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): ``dv_local = P^T dO`` over all of Dv."""
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // REP
    row0, _nbuf, _brow0, nrows = chunk_row(chunk_ptr, cid)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BVF)
    present = ot < nrows
    rows = row0 + ot
    base = cid * HV + h
    q = _row_tile(q_ptr, rows, present, SQ, hk * DK, ok, DK) * scale
    k = _row_tile(k_ptr, rows, present, SK, hk * DK, ok, DK)
    gc = tl.load(gcum_ptr + base * C + ot)
    causal = ot[:, None] >= ot[None, :]
    p = tl.where(
        causal, dot(q, tl.trans(k), None, PREC) * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0
    )
    do = _row_tile(do_ptr, rows, present, HV * DV, h * DV, ov, DV)
    tl.store(dvl_ptr + (base * C + ot[:, None]) * BVF + ov[None, :], dot(tl.trans(p), do, None, PREC))


@triton.jit
def _bwd_chain_kernel(
    q_ptr, do_ptr, chain_ptr, chunk_ptr, w_ptr, kd_ptr, gcum_ptr, egc_ptr, dvl_ptr, du_ptr, dsx_ptr, dxit_ptr, dent_ptr,
    scale, SQ, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, CARRY: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, Dv block), chunks last to first from ``dE' = 0`` (the final state is not an output
    of a training call): store ``dE'`` (``dsx``) and ``du = dv_local + KD dE'``, then
    ``dE = e^{G_C} dE' + (q e^G)^T dO - W^T du``, the previous chunk's ``dE'``.

    CARRY (a carried call, ``.carry``: an entry state in, the state at the last chunk boundary out): the exit's
    gradient (``dxit_ptr`` row of the chain's entry row, chain column 3) is the last chunk's ``dE'`` when that chunk
    closes, else it adds to the open chunk's ``dE`` (the exit is that chunk's entry state); the ``dE`` of the first
    chunk is the entry state's gradient, stored into ``dent_ptr``'s row. Without CARRY neither pointer is touched."""
    sid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // REP
    c0 = tl.load(chain_ptr + sid * 6).to(tl.int64)
    nc = tl.load(chain_ptr + sid * 6 + 1)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mv = ov < DV
    m2 = (ok < DK)[:, None] & mv[None, :]
    st = (h * DK + ok[:, None]) * DV + ov[None, :]
    hsz = HV * DK * DV
    ds = tl.zeros([BK, BV], dtype=tl.float32)
    if CARRY:
        erow = tl.load(chain_ptr + sid * 6 + 3).to(tl.int64)
        last_open = tl.load(chain_ptr + sid * 6 + 5)
        d_exit = tl.load(dxit_ptr + erow * hsz + st, mask=m2, other=0.0)
        ds = tl.where(last_open == 0, d_exit, ds)
    for jj in range(nc):
        cid = c0 + nc - 1 - jj
        base = cid * HV + h
        row0, _nbuf, _brow0, nrows = chunk_row(chunk_ptr, cid)
        present = ot < nrows
        rows = row0 + ot
        tl.store(dsx_ptr + cid * hsz + st, ds, mask=m2)
        kd = tl.load(kd_ptr + (base * C + ot[:, None]) * BK + ok[None, :])
        dvl = tl.load(dvl_ptr + (base * C + ot[:, None]) * BVF + ov[None, :], mask=mv[None, :], other=0.0)
        du = dot(kd, ds, dvl, PREC)
        tl.store(du_ptr + (base * C + ot[:, None]) * BVF + ov[None, :], du, mask=mv[None, :])
        gc = tl.load(gcum_ptr + base * C + ot)
        qd = _row_tile(q_ptr, rows, present, SQ, hk * DK, ok, DK) * (scale * tl.exp(gc))[:, None]
        do = _row_tile(do_ptr, rows, present, HV * DV, h * DV, ov, DV)
        w = tl.load(w_ptr + (base * C + ot[:, None]) * BK + ok[None, :])
        ds = dot(tl.trans(qd), do, tl.load(egc_ptr + base) * ds, PREC) - dot(tl.trans(w), du, None, PREC)
        if CARRY:  # noqa: SIM102  (the constexpr branch alone is compiled out without CARRY)
            if jj == 0:  # the last chunk: an open one's entry state is the exit
                ds = tl.where(last_open == 1, ds + d_exit, ds)
    if CARRY:
        tl.store(dent_ptr + erow * hsz + st, ds, mask=m2)


@triton.jit
def _bwd_output_kernel(
    q_ptr, k_ptr, do_ptr, chunk_ptr, u_ptr, du_ptr, ex_ptr, dsx_ptr, gcum_ptr, egc_ptr,
    dq_ptr, dk_ptr, dgp_ptr, dwm_ptr,
    scale, SQ, SK, HK, HV, DK, DV, REP, NT,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): the gradients through the output, the exit state and ``u = U0 - W E``.

    ``dP = dO u^T`` over Dv blocks first; then per slice of KS key columns, over Dv blocks: ``dO E^T``, ``u dE'^T``,
    ``du E^T`` and ``sum(dE' . E)``, from which the slice's dq (stored, scaled: the input's gradient), dk's part
    (``dk_ptr``, completed by the WY kernel) and ``du E^T`` (``dwm_ptr``: ``dW = -du E^T``); dG's part (``dgp_ptr``)
    sums over the slices. Key slices keep every accumulator a ``[C, KS]`` tile (register pressure)."""
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // REP
    row0, _nbuf, _brow0, nrows = chunk_row(chunk_ptr, cid)
    ot = tl.arange(0, C)
    present = ot < nrows
    rows = row0 + ot
    base = cid * HV + h
    hsz = HV * DK * DV
    d_p = tl.zeros([C, C], dtype=tl.float32)
    for vb in range(BVF // BV):
        ov = vb * BV + tl.arange(0, BV)
        do = _row_tile(do_ptr, rows, present, HV * DV, h * DV, ov, DV)
        u = tl.load(u_ptr + (base * C + ot[:, None]) * BVF + ov[None, :], mask=present[:, None] & (ov < DV)[None, :],
                    other=0.0)  # fmt: skip
        d_p = dot(do, tl.trans(u), d_p, PREC)
    gc = tl.load(gcum_ptr + base * C + ot)
    gl = tl.sum(tl.where(ot == C - 1, gc, 0.0), axis=0)
    kdec = tl.exp(gl - gc)
    eg = tl.exp(gc)
    causal = ot[:, None] >= ot[None, :]
    d_qk = tl.where(causal, d_p * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    d_g = tl.zeros([C], dtype=tl.float32)
    f_sum = tl.zeros([C], dtype=tl.float32)
    d_egc = tl.zeros([KS], dtype=tl.float32)
    for ks in range(BK // KS):
        oks = ks * KS + tl.arange(0, KS)
        mks = oks < DK
        d_qe = tl.zeros([C, KS], dtype=tl.float32)
        d_kd = tl.zeros([C, KS], dtype=tl.float32)
        du_e = tl.zeros([C, KS], dtype=tl.float32)
        for vb in range(BVF // BV):
            ov = vb * BV + tl.arange(0, BV)
            mv = ov < DV
            m2 = mks[:, None] & mv[None, :]
            st = (h * DK + oks[:, None]) * DV + ov[None, :]
            tile = (base * C + ot[:, None]) * BVF + ov[None, :]
            do = _row_tile(do_ptr, rows, present, HV * DV, h * DV, ov, DV)
            u = tl.load(u_ptr + tile, mask=present[:, None] & mv[None, :], other=0.0)
            du = tl.load(du_ptr + tile, mask=mv[None, :], other=0.0).to(tl.float32)
            e = tl.load(ex_ptr + cid * hsz + st, mask=m2, other=0.0).to(tl.float32)  # bf16 with bf16 dots
            dsx = tl.load(dsx_ptr + cid * hsz + st, mask=m2, other=0.0).to(tl.float32)
            d_qe = dot(do, tl.trans(e), d_qe, PREC)
            d_kd = dot(u, tl.trans(dsx), d_kd, PREC)
            du_e = dot(du, tl.trans(e), du_e, PREC)
            d_egc += tl.sum(dsx * e, axis=1)
        tl.store(dwm_ptr + (base * C + ot[:, None]) * BK + oks[None, :], du_e)
        m_rows = present[:, None] & mks[None, :]
        k = _row_tile(k_ptr, rows, present, SK, hk * DK, oks, DK)
        f = tl.sum(d_kd * k, axis=1) * kdec  # dKD . KD per row (this slice)
        f_sum += f
        d_k = kdec[:, None] * d_kd
        q = _row_tile(q_ptr, rows, present, SQ, hk * DK, oks, DK) * scale
        d_q = eg[:, None] * d_qe
        # Through P's decay: dG_t += sum_i dP_ti P_ti - sum_s dP_st P_st = q_t . dq_P,t - k_t . dk_P,t (no P tile)
        d_q_p = dot(d_qk, k, None, PREC)
        d_g += tl.sum(q * (d_q + d_q_p), axis=1) - f
        dq_at = _key_grad_rows(dq_ptr, rows, oks, h, hk, NT, HK, DK, REP)
        tl.store(dq_at, (d_q + d_q_p) * scale, mask=m_rows)
        d_k_p = dot(tl.trans(d_qk), q, None, PREC)
        d_g -= tl.sum(k * d_k_p, axis=1)
        tl.store(_key_grad_rows(dk_ptr, rows, oks, h, hk, NT, HK, DK, REP), d_k + d_k_p, mask=m_rows)
    d_gl = tl.sum(f_sum, axis=0) + tl.load(egc_ptr + base) * tl.sum(d_egc, axis=0)
    tl.store(dgp_ptr + base * C + ot, d_g + tl.where(ot == C - 1, d_gl, 0.0))


@triton.jit
def _bwd_wy_kernel(
    k_ptr, v_ptr, b_ptr, chunk_ptr, du_ptr, tinv_ptr, gcum_ptr, dwm_ptr, dgp_ptr,
    dk_ptr, dv_ptr, db_ptr, dg_ptr,
    SK, SV, SB, HK, HV, DK, DV, REP, NT,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): the gradients through the WY form, added to the output kernel's dk and dG parts.

    ``dX1 = T^{-T} du`` (dv = beta dX1), ``dX2 = -T^{-T} (du E^T)``, ``dA = -strict_lower((dX1 (beta v)^T +
    dX2 X2^T) T^{-T})`` with ``X2 = beta e^G k``; then through ``A = beta k k^T . e^{G_t - G_i}``; dg = the reverse
    in-chunk sum of dG (G is the in-chunk cumulative sum of g). Key columns in slices of KS, as in the output kernel:
    dk is read, added to and stored once per slice and pass."""
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // REP
    row0, _nbuf, _brow0, nrows = chunk_row(chunk_ptr, cid)
    ot = tl.arange(0, C)
    present = ot < nrows
    rows = row0 + ot
    base = cid * HV + h
    beta = tl.load(b_ptr + rows * SB + h, mask=present, other=0.0).to(tl.float32)
    tinv_t = tl.trans(tl.load(tinv_ptr + (base * C + ot[:, None]) * C + ot[None, :]))
    d_b = tl.zeros([C], dtype=tl.float32)
    m = tl.zeros([C, C], dtype=tl.float32)
    for vb in range(BVF // BV):
        ov = vb * BV + tl.arange(0, BV)
        mv = ov < DV
        du = tl.load(du_ptr + (base * C + ot[:, None]) * BVF + ov[None, :], mask=mv[None, :], other=0.0).to(tl.float32)
        v = _row_tile(v_ptr, rows, present, SV, h * DV, ov, DV)
        d_x1 = dot(tinv_t, du, None, PREC)
        d_v = (beta[:, None] * d_x1).to(dv_ptr.dtype.element_ty)
        tl.store(dv_ptr + (rows[:, None] * HV + h) * DV + ov[None, :], d_v, mask=present[:, None] & mv[None, :])
        d_b += tl.sum(v * d_x1, axis=1)
        m = dot(d_x1, tl.trans(beta[:, None] * v), m, PREC)
    gc = tl.load(gcum_ptr + base * C + ot)
    eg = tl.exp(gc)
    d_gt = tl.load(dgp_ptr + base * C + ot)
    for ks in range(BK // KS):  # through X2
        oks = ks * KS + tl.arange(0, KS)
        m_rows = present[:, None] & (oks < DK)[None, :]
        k = _row_tile(k_ptr, rows, present, SK, hk * DK, oks, DK)
        x2 = (beta * eg)[:, None] * k
        d_x2 = -dot(tinv_t, tl.load(dwm_ptr + (base * C + ot[:, None]) * BK + oks[None, :]).to(tl.float32), None, PREC)
        m = dot(d_x2, tl.trans(x2), m, PREC)
        d_gt += tl.sum(x2 * d_x2, axis=1)
        d_b += tl.sum(eg[:, None] * k * d_x2, axis=1)
        dk_at = _key_grad_rows(dk_ptr, rows, oks, h, hk, NT, HK, DK, REP)
        tl.store(dk_at, tl.load(dk_at, mask=m_rows, other=0.0) + (beta * eg)[:, None] * d_x2, mask=m_rows)
    lower = ot[:, None] > ot[None, :]
    dec = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
    d_kk = tl.where(lower, -dot(m, tinv_t, None, PREC), 0.0) * dec  # d(beta k k^T) on the strict lower triangle
    for ks in range(BK // KS):  # through A
        oks = ks * KS + tl.arange(0, KS)
        m_rows = present[:, None] & (oks < DK)[None, :]
        k = _row_tile(k_ptr, rows, present, SK, hk * DK, oks, DK)
        kb = beta[:, None] * k
        d_kb = dot(d_kk, k, None, PREC)
        d_k_a = dot(tl.trans(d_kk), kb, None, PREC)
        d_b += tl.sum(k * d_kb, axis=1)
        # Through A's decay, as for P in the output kernel: dG_t += kb_t . dkb_t - k_t . dk_A,t (no A tile)
        d_gt += tl.sum(kb * d_kb, axis=1) - tl.sum(k * d_k_a, axis=1)
        dk_at = _key_grad_rows(dk_ptr, rows, oks, h, hk, NT, HK, DK, REP)
        tl.store(dk_at, tl.load(dk_at, mask=m_rows, other=0.0) + beta[:, None] * d_kb + d_k_a, mask=m_rows)
    # dg_t = sum_{s >= t} dG_s: a dot with the upper-triangular ones (16 columns: tl.dot's minimum width)
    o16 = tl.arange(0, 16)
    upper_eq = tl.where(ot[:, None] <= ot[None, :], 1.0, 0.0)
    d_g16 = tl.where(o16[None, :] == 0, d_gt[:, None], 0.0)
    d_g = tl.sum(tl.where(o16[None, :] == 0, tl.dot(upper_eq, d_g16, input_precision="ieee"), 0.0), axis=1)
    tl.store(db_ptr + rows * HV + h, d_b, mask=present)
    tl.store(dg_ptr + rows * HV + h, d_g, mask=present)


def chain_block(prec: str) -> int:
    """The chain program's Dv block at dot precision ``prec``."""
    return BWD_CHAIN_BV_BF16 if prec == "bf16" else BWD_CHAIN_BV


def rule_backward(
    d_out: torch.Tensor,
    rows: tuple[tuple[torch.Tensor, int], ...],
    shapes: tuple[int, int, int, int],
    plan,
    states: tuple[torch.Tensor, ...],
    cfg,
    scale: float,
    carry: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of q, k, v, g, beta from ``d_out`` ``[T, Hv, Dv]``: fp32, except dv, in v's kernel dtype.

    ``rows``: q, k, v, g, beta as ``rule._rows`` returns them (tensor, row stride); ``shapes``: (Hk, Dk, Hv, Dv);
    ``plan``: the call's chunk-form plan; ``states``: its chunk-form state pass, ``(u, W, KD, e^{G_C}, G, T^{-1},
    E)`` (:func:`.state_pass.state_pass` and the entry states it fills); ``cfg``: the forward's ``GDNConfig``.
    ``carry``: a carried call's ``(d_exit, d_entry)``, fp32 contiguous ``[n, Hv, Dk, Dv]``: the exit state's gradient
    in, the entry state's written (the plan a carried one, ``plan._plan(carry=True)``)."""
    (qf, sq), (kf, sk), (vf, sv), (_gf, _sg), (bf, sb) = rows
    hk, dk, hv, dv = shapes
    u, w, kd, egc, gcum, tinv, ex = states
    t, dev, c, n, rep = d_out.shape[0], d_out.device, cfg.chunk, plan.nchunks, hv // hk
    prec = cfg.chain_precision
    d_out = d_out.float().contiguous()  # the rule's output is fp32, so its gradient already is: no copy
    bv, chain_bv = (max(MIN_DOT, min(b, cfg.bv_full)) for b in (BWD_BV, chain_block(prec)))
    f32 = {"dtype": torch.float32, "device": dev}
    # du, dE' and du E^T only ever enter dots: with bf16 dots they are stored as the bf16 those dots round them to
    # (dE' also enters sum(dE' . E), the gradient of e^{G_C}, there rounded)
    mid = {"dtype": torch.bfloat16 if prec == "bf16" else torch.float32, "device": dev}
    dvl = torch.empty(n, hv, c, cfg.bv_full, **f32)
    du = torch.empty(n, hv, c, cfg.bv_full, **mid)
    dsx = torch.empty(n, hv, dk, dv, **mid)
    dwm = torch.empty(n, hv, c, cfg.bk, **mid)
    dgp = torch.empty(n, hv, c, **f32)
    dq = torch.empty(rep, t, hk, dk, **f32)  # per value head, in planes (_key_grad_rows)
    dkk = torch.empty(rep, t, hk, dk, **f32)
    # dv is final where the WY kernel stores it: in v's dtype, rounded as a torch cast would (no cast kernel after)
    dvv = torch.empty(t, hv, dv, dtype=vf.dtype, device=dev)
    db = torch.empty(t, hv, **f32)
    dg = torch.empty(t, hv, **f32)
    dims = {"C": c, "BK": cfg.bk, "BVF": cfg.bv_full, "PREC": prec}
    ks = max(MIN_DOT, min(BWD_KS, cfg.bk))
    _bwd_local_kernel[(n, hv)](
        qf, kf, d_out, plan.chunks, gcum, dvl, scale, sq, sk, hk, hv, dk, dv, rep, **dims, num_warps=BWD_WARPS,
        **maxnreg(BWD_MAXNREG),
    )  # fmt: skip
    d_exit, d_entry = carry if carry is not None else (dvl, dvl)  # never read or written without CARRY
    _bwd_chain_kernel[(plan.nchains, hv, triton.cdiv(dv, chain_bv))](
        qf, d_out, plan.chains, plan.chunks, w, kd, gcum, egc, dvl, du, dsx, d_exit, d_entry, scale, sq, hk, hv, dk,
        dv, rep, **dims, BV=chain_bv, CARRY=carry is not None, num_warps=BWD_CHAIN_WARPS, num_stages=BWD_CHAIN_STAGES, **maxnreg(BWD_CHAIN_MAXNREG),
    )  # fmt: skip
    _bwd_output_kernel[(n, hv)](
        qf, kf, d_out, plan.chunks, u, du, ex, dsx, gcum, egc, dq, dkk, dgp, dwm, scale, sq, sk, hk, hv, dk, dv, rep, t,
        **dims, BV=bv, KS=ks, num_warps=BWD_WARPS, **maxnreg(BWD_MAXNREG),
    )  # fmt: skip
    _bwd_wy_kernel[(n, hv)](
        kf, vf, bf, plan.chunks, du, tinv, gcum, dwm, dgp, dkk, dvv, db, dg, sk, sv, sb, hk, hv, dk, dv, rep, t,
        **dims, BV=bv, KS=ks, num_warps=BWD_WARPS, **maxnreg(BWD_MAXNREG),
    )  # fmt: skip
    return key_head_sum(dq), key_head_sum(dkk), dvv, dg, db


def key_head_sum(planes: torch.Tensor) -> torch.Tensor:
    """``[rep, T, Hk, D]`` -> ``[T, Hk, D]``: plane r holds value head ``j * rep + r`` of key head j; the planes are
    added one after another in ascending order (fixed: deterministic), each add over whole contiguous tensors: at copy
    bandwidth, faster than a torch sum over a strided middle dim of size rep (``[T, Hk, rep, D]``) or adds of strided
    views of it."""
    out = planes[0]
    for r in range(1, planes.shape[0]):
        out = out + planes[r]
    return out
