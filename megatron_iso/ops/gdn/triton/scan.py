"""The scan form's outputs: the per-token recurrence over each segment of a call (docs/GDN.md, "Scan form")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.gdn.triton import tuning
from megatron_iso.ops.gdn.triton.plan import Plan
from megatron_iso.ops.gdn.triton.tuning import GDNConfig, maxnreg


@triton.jit
def _scan_token_inputs(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, r, valid, scale, SQ, SK, SV, SG, SB, h, hk, DK, DV, ok, ov, mk, mv
):
    """Row r's k, q (scaled), v block, g, beta, widened to fp32; zeros where ``valid`` is false."""
    kt = tl.load(k_ptr + r * SK + hk * DK + ok, mask=mk & valid, other=0.0).to(tl.float32)
    qt = tl.load(q_ptr + r * SQ + hk * DK + ok, mask=mk & valid, other=0.0).to(tl.float32) * scale
    vt = tl.load(v_ptr + r * SV + h * DV + ov, mask=mv & valid, other=0.0).to(tl.float32)
    gt = tl.load(g_ptr + r * SG + h, mask=valid, other=0.0).to(tl.float32)
    bt = tl.load(b_ptr + r * SB + h, mask=valid, other=0.0).to(tl.float32)
    return kt, qt, vt, gt, bt


@triton.jit
def _scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, seg_ptr, run_ptr, ex_ptr, fin_ptr,
    bk_ptr, bv_ptr, bg_ptr, bb_ptr,
    scale, SQ, SK, SV, SG, SB, HK, HV, DK, DV, REP,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per-token recurrence over one segment for one (value head, Dv block).

    seg row (int32 x 8): first packed row, length, init kind (0 zeros / 1 run_ptr / 2 ex_ptr), init
    row, final row (-1: none), final kind (0 own state / 1 ex_ptr row), final source row, buffer row of
    the segment's first token (-1: none; else the segment leaves its chunk open and its tokens are copied
    into the state cache's ``buf_*`` rows from there on).

    q/k/v/g/beta are read in their own dtype (fp32, bf16 or fp16: exact to fp32) at row strides
    SQ..SB (inner dims contiguous). The buffer copy stores the values this program already loaded (v in
    buf_v's dtype, which holds it exactly): v's Dv block by every program, g and beta by the Dv block 0 program, k's
    key head by the Dv block 0 program of the first value head reading it, so every buffer element has one writer.
    """
    sid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // REP
    row0 = tl.load(seg_ptr + sid * 8).to(tl.int64)
    n = tl.load(seg_ptr + sid * 8 + 1)
    init_kind = tl.load(seg_ptr + sid * 8 + 2)
    init_row = tl.load(seg_ptr + sid * 8 + 3).to(tl.int64)
    fin_row = tl.load(seg_ptr + sid * 8 + 4).to(tl.int64)
    fin_kind = tl.load(seg_ptr + sid * 8 + 5)
    fin_src = tl.load(seg_ptr + sid * 8 + 6).to(tl.int64)
    brow0 = tl.load(seg_ptr + sid * 8 + 7).to(tl.int64)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    wbuf = brow0 >= 0
    wgb = wbuf & (vb == 0)
    wk = wgb & (h % REP == 0)
    st = (h * DK + ok[:, None]) * DV + ov[None, :]  # offset of S[h] block inside one [HV, DK, DV] state
    hsz = HV * DK * DV
    if init_kind == 1:
        s = tl.load(run_ptr + init_row * hsz + st, mask=m2, other=0.0)
    elif init_kind == 2:
        s = tl.load(ex_ptr + init_row * hsz + st, mask=m2, other=0.0)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    # Token t+1's inputs are loaded while token t is computed (one token ahead; masked past the segment's end):
    # the loads move, the arithmetic does not.
    kt, qt, vt, gt, bt = _scan_token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, row0, n > 0, scale, SQ, SK, SV, SG,
                                            SB, h, hk, DK, DV, ok, ov, mk, mv)  # fmt: skip
    for t in range(n):
        r = row0 + t
        kn, qn, vn, gn, bn = _scan_token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, r + 1, t + 1 < n, scale, SQ, SK,
                                                SV, SG, SB, h, hk, DK, DV, ok, ov, mk, mv)  # fmt: skip
        br = brow0 + t  # buffer row (only stored to when wbuf)
        tl.store(bv_ptr + (br * HV + h) * DV + ov, vt.to(bv_ptr.dtype.element_ty), mask=mv & wbuf)
        tl.store(bk_ptr + (br * HK + hk) * DK + ok, kt, mask=mk & wk)
        tl.store(bg_ptr + br * HV + h, gt, mask=wgb)
        tl.store(bb_ptr + br * HV + h, bt, mask=wgb)
        s = s * tl.exp(gt)
        u = bt * (vt - tl.sum(s * kt[:, None], axis=0))
        s = s + kt[:, None] * u[None, :]
        ot = tl.sum(s * qt[:, None], axis=0)
        tl.store(o_ptr + (r * HV + h) * DV + ov, ot, mask=mv)
        kt, qt, vt, gt, bt = kn, qn, vn, gn, bn
    if fin_row >= 0:
        if fin_kind == 1:  # the segment closed its chunk: the running state is the chunk's exit state
            s = tl.load(ex_ptr + fin_src * hsz + st, mask=m2, other=0.0)
        tl.store(fin_ptr + fin_row * hsz + st, s, mask=m2)


def scan_outputs(
    q: tuple[torch.Tensor, int],
    rows: tuple,
    buffers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    plan: Plan,
    running: torch.Tensor,
    ex: torch.Tensor,
    fin: torch.Tensor,
    cfg: GDNConfig,
    scale: float,
) -> None:
    """``_scan_kernel`` per (segment, value head, Dv block) of ``plan`` into ``out``: each segment from its start state
    (zeros, ``running``'s slot row or ``ex``'s chunk exit row), final states into ``fin``; the tokens of a chunk the
    call leaves open go to ``buffers`` (the state cache's buf_k, buf_v, buf_g, buf_beta). ``q``, ``rows`` (k, v, g,
    beta): as the rule's ``_rows`` returns them (tensor, row stride)."""
    qf, sq = q
    (kf, sk), (vf, sv), (gf, sg), (bf, sb) = rows
    hk, dk = kf.shape[1:]
    hv, dv = vf.shape[1:]
    _scan_kernel[(plan.nseg, hv, triton.cdiv(dv, cfg.scan_bv))](
        qf, kf, vf, gf, bf, out, plan.seg, running, ex, fin, *buffers, scale, sq, sk, sv, sg, sb,
        hk, hv, dk, dv, hv // hk, BK=cfg.bk, BV=cfg.scan_bv, num_warps=tuning.SCAN_WARPS,
        **maxnreg(tuning.SCAN_MAXNREG),
    )  # fmt: skip
