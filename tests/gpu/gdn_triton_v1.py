"""FROZEN copy of the GDN state-pass kernels as of commit 23adb74 (gdn_triton VERSION "1", before the
K-blocked dots). Kept ONLY for the one-off GPU equality test in tests/gpu/test_gdn_triton_blocked.py: the
blocked kernels in megatron_iso/ops/gdn/gdn_triton.py must give these kernels' bits. Do not edit, do not
import from library code; delete together with that test once the equality has been confirmed on the GPU.
"""

# ruff: noqa
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _prep_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, chunk_ptr,
    u0_ptr, w_ptr, kd_ptr, egc_ptr,
    HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
):  # fmt: skip
    """Per (closing chunk, value head): U0, W, KD = e^{G_C-G} k and e^{G_C} of the WY form.

    chunk row (int32 x 3): packed row of the chunk's token 0 (tokens >= ``buffered`` are packed rows
    ``row0 + t``), ``buffered`` (tokens 0..buffered-1 are in the state cache buffer), buffer row base.
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // REP
    row0 = tl.load(chunk_ptr + cid * 3).to(tl.int64)
    nbuf = tl.load(chunk_ptr + cid * 3 + 1)
    brow0 = tl.load(chunk_ptr + cid * 3 + 2).to(tl.int64)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BVF)
    mk = ok < DK
    mv = ov < DV
    in_buf = ot < nbuf
    rows = row0 + ot
    brows = brow0 + ot
    # Buffered tokens and packed rows hold the same fp32 values: both sources give the same chunk.
    kb = tl.load(bk_ptr + (brows[:, None] * HK + hk) * DK + ok[None, :], mask=in_buf[:, None] & mk[None, :], other=0.0)
    kr = tl.load(k_ptr + (rows[:, None] * HK + hk) * DK + ok[None, :], mask=(~in_buf[:, None]) & mk[None, :], other=0.0)
    kc = tl.where(in_buf[:, None], kb, kr)
    vb_ = tl.load(bvv_ptr + (brows[:, None] * HV + h) * DV + ov[None, :], mask=in_buf[:, None] & mv[None, :], other=0.0)
    vr = tl.load(v_ptr + (rows[:, None] * HV + h) * DV + ov[None, :], mask=(~in_buf[:, None]) & mv[None, :], other=0.0)
    vc = tl.where(in_buf[:, None], vb_, vr)
    gc = tl.where(
        in_buf,
        tl.load(bg_ptr + brows * HV + h, mask=in_buf, other=0.0),
        tl.load(g_ptr + rows * HV + h, mask=~in_buf, other=0.0),
    )
    bc = tl.where(
        in_buf,
        tl.load(bb_ptr + brows * HV + h, mask=in_buf, other=0.0),
        tl.load(b_ptr + rows * HV + h, mask=~in_buf, other=0.0),
    )
    cum = tl.cumsum(gc, axis=0)  # G_t
    gl = tl.sum(tl.where(ot == C - 1, cum, 0.0), axis=0)  # G_C
    lower = ot[:, None] > ot[None, :]
    kk = tl.dot(kc, tl.trans(kc), input_precision="ieee")
    dec = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0))
    a = tl.where(lower, bc[:, None] * dec * kk, 0.0)
    # T^{-1} for T = I + A (unit lower triangular), row by row: row t = e_t - sum_{i<t} A_ti row_i.
    eye = tl.where(ot[:, None] == ot[None, :], 1.0, 0.0)
    tinv = eye
    for t in range(1, C):
        at = tl.sum(tl.where(ot[:, None] == t, a, 0.0), axis=0)  # A[t, :]
        row = tl.sum(at[:, None] * tinv, axis=0)
        tinv = tl.where(ot[:, None] == t, eye - row[None, :], tinv)
    u0 = tl.dot(tinv, bc[:, None] * vc, input_precision="ieee")
    w = tl.dot(tinv, (bc * tl.exp(cum))[:, None] * kc, input_precision="ieee")
    kd = tl.exp(gl - cum)[:, None] * kc
    base = cid * HV + h
    tl.store(u0_ptr + (base * C + ot[:, None]) * BVF + ov[None, :], u0)
    tl.store(w_ptr + (base * C + ot[:, None]) * BK + ok[None, :], w)
    tl.store(kd_ptr + (base * C + ot[:, None]) * BK + ok[None, :], kd)
    tl.store(egc_ptr + base, tl.exp(gl))


@triton.jit
def _chain_kernel(
    chain_ptr, entry_ptr, u0_ptr, w_ptr, kd_ptr, egc_ptr, ex_ptr,
    HV, DK, DV,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, Dv block): entry -> exit state over the sequence's closing chunks.

    chain row (int32 x 5): first chunk index, number of chunks, entry kind (0 zeros / 1 entry_ptr
    row), entry row (the slot), write back (1: store the last state into entry_ptr's row).
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    c0 = tl.load(chain_ptr + cid * 5).to(tl.int64)
    nc = tl.load(chain_ptr + cid * 5 + 1)
    ekind = tl.load(chain_ptr + cid * 5 + 2)
    erow = tl.load(chain_ptr + cid * 5 + 3).to(tl.int64)
    wb = tl.load(chain_ptr + cid * 5 + 4)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
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
    for j in range(nc):
        base = (c0 + j) * HV + h
        u0 = tl.load(u0_ptr + (base * C + ot[:, None]) * BVF + ov[None, :], mask=mv[None, :], other=0.0)
        w = tl.load(w_ptr + (base * C + ot[:, None]) * BK + ok[None, :])
        kd = tl.load(kd_ptr + (base * C + ot[:, None]) * BK + ok[None, :])
        egc = tl.load(egc_ptr + base)
        u = u0 - tl.dot(w, e, input_precision="ieee")
        e = egc * e + tl.dot(tl.trans(kd), u, input_precision="ieee")
        tl.store(ex_ptr + (c0 + j) * hsz + st, e, mask=m2)
    if wb == 1:
        tl.store(entry_ptr + erow * hsz + st, e, mask=m2)
