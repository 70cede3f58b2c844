"""conv1d + SiLU, l2norm and the gates: one element (conv, gates) or one row (l2norm) per program lane, fixed block
sizes; nothing depends on the number of rows. Backward: the conv's by two Triton kernels (``conv_backward``: it ran
as ~25 fp32 passes over [tokens, conv channels] in torch, the largest elementwise cost of the hybrid trainer);
l2norm's by the row-norm backward kernel (``ops.norm.norm_backward_triton``); the gates' (small: [tokens, heads]) by
autograd of a plain torch form (:func:`_conv_plain` is kept as the conv backward's reference)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.autograd import with_fused_backward, with_plain_backward
from megatron_iso.ops.common.rows import strided_rows
from megatron_iso.ops.gdn import native
from megatron_iso.ops.gdn.checks import check_conv_args, check_state_slots
from megatron_iso.ops.gdn.reference import L2NORM_EPS
from megatron_iso.ops.gdn.triton import tuning
from megatron_iso.ops.norm.norm_backward_triton import l2norm_backward


@triton.jit
def _sequence_of_row(cu_ptr, r, N):
    """The sequence holding packed row ``r``: the largest ``s < N`` with ``cu[s] <= r`` (an empty sequence shares
    its start with the next one, which wins), by bisection over ``cu`` (no per-row index tensor to build)."""
    lo = 0
    hi = N - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_ptr + mid).to(tl.int64) <= r:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, y_ptr, cu_ptr, starts_ptr, slots_ptr, cs_ptr, CD, SX, N,
    K: tl.constexpr, KP: tl.constexpr, HAS_STATE: tl.constexpr, STATE_WRITE: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """One packed row, BC channels: silu(sum_j w[:, j] x[t-K+1+j]); history from the conv state. ``x`` rows are SX
    elements apart (a column slice of the input projection reads in place). ``STATE_WRITE`` (every sequence one row:
    a decode step) also writes the row's conv state (:func:`_write_conv_state` with one row), without
    ``_conv_state_kernel``'s second launch (no other program reads this state: one row each)."""
    r = tl.program_id(0).to(tl.int64)
    oc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = oc < CD
    sid = _sequence_of_row(cu_ptr, r, N)
    a = tl.load(cu_ptr + sid).to(tl.int64)
    p = r - a  # position inside this call's rows of the sequence
    if HAS_STATE:
        warm = tl.load(starts_ptr + sid) > 0
        slot = tl.load(slots_ptr + sid).to(tl.int64)
    else:
        warm = False
        slot = 0
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = p - (K - 1) + j
        xr = tl.load(x_ptr + (r - (K - 1) + j) * SX + oc, mask=mc & (src >= 0), other=0.0).to(tl.float32)
        hs = tl.load(cs_ptr + (slot * CD + oc) * (K - 1) + (K - 1) + src, mask=mc & (src < 0) & warm, other=0.0)
        xv = tl.where(src >= 0, xr, hs.to(tl.float32))
        wj = tl.load(w_ptr + oc * K + j, mask=mc, other=0.0).to(tl.float32)
        acc = acc + wj * xv
    y = tl.math.div_rn(acc, 1.0 + tl.exp(-acc))
    tl.store(y_ptr + r * CD + oc, y.to(y_ptr.dtype.element_ty), mask=mc)
    if STATE_WRITE:
        _write_conv_state(x_ptr, cs_ptr, r, 1, warm, slot, oc, mc, CD, SX, K, KP)


@triton.jit
def _write_conv_state(x_ptr, cs_ptr, a, n, warm, slot, oc, mc, CD, SX, K: tl.constexpr, KP: tl.constexpr):
    """conv_state[slot] (channels ``oc``) = the last K-1 inputs of the sequence whose ``n`` rows of this call start
    at row ``a``: rows of the call, older ones from the old state (zeros unless ``warm``). Every value is loaded
    before the one store, so a state this program also read is replaced only after."""
    jj = tl.arange(0, KP)
    mj = jj < K - 1
    idx = n - (K - 1) + jj  # row inside the call (< 0: from the old state, column K-1+idx)
    m = mc[:, None] & mj[None, :]
    xr = tl.load(x_ptr + (a + idx[None, :]) * SX + oc[:, None], mask=m & (idx[None, :] >= 0), other=0.0)
    old = tl.load(
        cs_ptr + (slot * CD + oc[:, None]) * (K - 1) + (K - 1) + idx[None, :],
        mask=m & (idx[None, :] < 0) & warm,
        other=0.0,
    )
    val = tl.where(idx[None, :] >= 0, xr.to(cs_ptr.dtype.element_ty), old)
    tl.store(cs_ptr + (slot * CD + oc[:, None]) * (K - 1) + jj[None, :], val, mask=m)


@triton.jit
def _conv_state_kernel(
    x_ptr, cu_ptr, starts_ptr, slots_ptr, cs_ptr, CD, SX,
    K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """conv_state[slot] = the sequence's last K-1 inputs (older ones from the state or zeros)."""
    i = tl.program_id(0)
    oc = tl.program_id(1) * BC + tl.arange(0, BC)
    a = tl.load(cu_ptr + i).to(tl.int64)
    n = tl.load(cu_ptr + i + 1).to(tl.int64) - a
    warm = tl.load(starts_ptr + i) > 0
    slot = tl.load(slots_ptr + i).to(tl.int64)
    _write_conv_state(x_ptr, cs_ptr, a, n, warm, slot, oc, oc < CD, CD, SX, K, KP)


@triton.jit
def _l2norm_kernel(x_ptr, y_ptr, D, HPT, S_TOKEN, S_HEAD, eps, BD: tl.constexpr):
    """Row ``r`` = head ``r % HPT`` of token ``r // HPT``, read at ``x``'s strides (q and k are column slices of the
    conv output); ``y`` contiguous."""
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    src = (r // HPT) * S_TOKEN + (r % HPT) * S_HEAD
    x = tl.load(x_ptr + src + o, mask=o < D, other=0.0).to(tl.float32)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) + eps))
    tl.store(y_ptr + r * D + o, x * inv, mask=o < D)


@triton.jit
def _gates_kernel(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, N, H, SA, SB, BLOCK: tl.constexpr):
    """g in float64 (libdevice exp/log), rounded once: softplus(x) = max(x, 0) + log1p(exp(-|x|)) with
    log1p(y) = log(u) * y / (u - 1), u = 1 + y, accurate for tiny y; beta = 1 / (1 + exp(-b)) in fp32. ``a`` and
    ``b`` rows are SA / SB elements apart (column slices of the input projection)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    h = i % H
    tok = i // H
    x = tl.load(a_ptr + tok * SA + h, mask=m, other=0.0).to(tl.float64)
    x = x + tl.load(dt_ptr + h, mask=m, other=0.0).to(tl.float64)
    y = tl.exp(-tl.abs(x))
    uu = 1.0 + y
    d = uu - 1.0
    l1p = tl.where(d == 0.0, y, tl.log(uu) * (y / tl.where(d == 0.0, 1.0, d)))
    sp = tl.maximum(x, 0.0) + l1p
    al = tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float64)
    tl.store(g_ptr + i, (-(tl.exp(al) * sp)).to(tl.float32), mask=m)
    b = tl.load(b_ptr + tok * SB + h, mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + i, tl.math.div_rn(1.0, 1.0 + tl.exp(-b)), mask=m)


@triton.jit
def _conv_bwd_da_kernel(
    x_ptr, w_ptr, dy_ptr, da_ptr, dwp_ptr, sid_ptr, cu_ptr, T, CD,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """BT rows x BC channels: ``da = dy * silu'(a)`` with ``a`` recomputed as the forward computes it (no conv state:
    a training call), and this row block's partial weight gradient ``sum_t da[t] x[t - shift]`` per tap."""
    pid_t = tl.program_id(0)
    o_t = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_t = o_t < T
    m_c = o_c < CD
    m = m_t[:, None] & m_c[None, :]
    sid = tl.load(sid_ptr + o_t, mask=m_t, other=0)
    p = o_t - tl.load(cu_ptr + sid, mask=m_t, other=0).to(tl.int64)  # position in the sequence
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        shift = K - 1 - j
        b_x = tl.load(x_ptr + (o_t[:, None] - shift) * CD + o_c[None, :], mask=m & (p[:, None] >= shift), other=0.0)
        b_w = tl.load(w_ptr + o_c * K + j, mask=m_c, other=0.0).to(tl.float32)
        acc = acc + b_w[None, :] * b_x.to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-acc))
    b_dy = tl.load(dy_ptr + o_t[:, None] * CD + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    b_da = b_dy * sig * (1.0 + acc * (1.0 - sig))
    tl.store(da_ptr + o_t[:, None] * CD + o_c[None, :], b_da, mask=m)
    for j in tl.static_range(K):
        shift = K - 1 - j
        b_x = tl.load(x_ptr + (o_t[:, None] - shift) * CD + o_c[None, :], mask=m & (p[:, None] >= shift), other=0.0)
        part = tl.sum(b_da * b_x.to(tl.float32), axis=0)
        tl.store(dwp_ptr + (pid_t.to(tl.int64) * CD + o_c) * K + j, part, mask=m_c)


@triton.jit
def _conv_bwd_dx_kernel(
    da_ptr, w_ptr, dx_ptr, sid_ptr, cu_ptr, T, CD,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """``dx[t] = sum_j w[:, j] da[t + shift_j]`` over the taps whose output row is in t's own sequence."""
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_t = o_t < T
    m_c = o_c < CD
    m = m_t[:, None] & m_c[None, :]
    sid = tl.load(sid_ptr + o_t, mask=m_t, other=0)
    end = tl.load(cu_ptr + sid + 1, mask=m_t, other=0).to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        shift = K - 1 - j
        ok = (o_t + shift) < end
        b_da = tl.load(da_ptr + (o_t[:, None] + shift) * CD + o_c[None, :], mask=m & ok[:, None], other=0.0)
        b_w = tl.load(w_ptr + o_c * K + j, mask=m_c, other=0.0).to(tl.float32)
        acc = acc + b_w[None, :] * b_da
    tl.store(dx_ptr + o_t[:, None] * CD + o_c[None, :], acc.to(dx_ptr.dtype.element_ty), mask=m)


def conv_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx in x's dtype, dweight in the weight's dtype)`` of the training conv + SiLU (no conv state).

    Deterministic: the weight gradient sums fixed blocks of CONV_BWD_BT rows per program, then the blocks in one
    fixed-shape reduction. fp32 throughout, one rounding per output, as the plain form's autograd."""
    t, cd = x.shape
    kw = weight.shape[-1]
    x, w, dy = x.contiguous(), weight.contiguous(), dy.contiguous()
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    sid = torch.searchsorted(cu[1:], torch.arange(t, device=x.device, dtype=torch.int32), right=True).to(torch.int32)
    bt, bc = tuning.CONV_BWD_BT, tuning.CONV_BWD_BC
    n_blocks = triton.cdiv(t, bt)
    da = torch.empty(t, cd, dtype=torch.float32, device=x.device)
    dwp = torch.empty(n_blocks, cd, kw, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    if t:
        grid = (n_blocks, triton.cdiv(cd, bc))
        _conv_bwd_da_kernel[grid](x, w, dy, da, dwp, sid, cu, t, cd, K=kw, BT=bt, BC=bc)
        _conv_bwd_dx_kernel[grid](da, w, dx, sid, cu, t, cd, K=kw, BT=bt, BC=bc)
    return dx, dwp.sum(0).to(weight.dtype)


class _ConvFunction(torch.autograd.Function):
    """The training conv: the invariant forward kernel, the Triton backward above."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, forward):  # type: ignore[override]
        ctx.save_for_backward(x, weight, cu_seqlens)
        return forward(x, weight, cu_seqlens)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, cu_seqlens = ctx.saved_tensors
        dx, dw = conv_backward(dy, x, weight, cu_seqlens)
        return dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None, None


def _conv_forward(x, weight, cu_seqlens, conv_state, slots, starts):
    check_conv_args(x, weight)
    t, cd = x.shape
    kw = weight.shape[-1]
    n = cu_seqlens.numel() - 1
    has = conv_state is not None
    # The starts are read back only without a state: a decode step (with its state) reads nothing to the host.
    check_state_slots(has, slots, n, () if has or starts is None else starts.reshape(-1).tolist(), conv=True)
    if has and (conv_state.shape[1:] != (cd, kw - 1) or not conv_state.is_contiguous()):
        raise ValueError(
            f"causal_conv1d: conv_state must be contiguous [slots, {cd}, {kw - 1}], got {tuple(conv_state.shape)}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((t, cd), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    st = (starts if starts is not None else torch.zeros(n, dtype=torch.int64)).to(device=x.device, dtype=torch.int64)
    sl = slots.to(device=x.device, dtype=torch.int64) if has else st
    cs = conv_state if has else x
    grid = (t, triton.cdiv(cd, tuning.CONV_BC))
    # One row per sequence (n == t: a decode step, the rule's own criterion) shifts the state in the same launch.
    one_row_each = has and n == t
    kp = triton.next_power_of_2(max(kw - 1, 1))
    _conv_kernel[grid](
        x, weight.contiguous(), y, cu, st, sl, cs, cd, x.stride(0), n,
        K=kw, KP=kp, HAS_STATE=has, STATE_WRITE=one_row_each, BC=tuning.CONV_BC,
    )  # fmt: skip
    if has and not one_row_each:
        _conv_state_kernel[(n, triton.cdiv(cd, tuning.CONV_BC))](
            x, cu, st, sl, conv_state, cd, x.stride(0), K=kw, KP=kp, BC=tuning.CONV_BC
        )
    return y


def _conv_plain(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Differentiable conv + SiLU for the backward: shifted copies by pad/slice (no scatter, so the
    gradient is deterministic), zeroed before each sequence's start."""
    t = x.shape[0]
    kw = weight.shape[-1]
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    ar = torch.arange(t, device=x.device)
    pos = ar - cu[torch.searchsorted(cu[1:], ar, right=True)]
    xf, wf = x.float(), weight.float()
    acc = None
    for j in range(kw):
        shift = kw - 1 - j
        xs = torch.nn.functional.pad(xf, (0, 0, shift, 0))[:t] * (pos >= shift)[:, None]
        term = wf[:, j] * xs
        acc = term if acc is None else acc + term
    return torch.nn.functional.silu(acc).to(x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU (``x [T, Cd]``, ``weight [Cd, K]``); updates ``conv_state`` like the reference."""
    fwd = functools.partial(_conv_forward, conv_state=conv_state, slots=slots, starts=starts)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not needs_grad:
        return fwd(x, weight, cu_seqlens)
    if conv_state is not None:
        raise NotImplementedError(
            "causal_conv1d (triton): gradients through a call with a conv state are not supported"
        )
    return _ConvFunction.apply(x, weight, cu_seqlens, fwd)


def _l2norm_forward(x: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = x.numel() // max(d, 1)
    if rows:
        xs, hpt, s_token, s_head = strided_rows(x)
        _l2norm_kernel[(rows,)](xs, y, d, hpt, s_token, s_head, float(eps), BD=triton.next_power_of_2(d))
    return y


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fp32 ``x / sqrt(sum(x^2) + eps)`` over the last dim: one row per program, fixed block."""
    return with_fused_backward(_l2norm_forward, l2norm_backward, x, eps)


def _gates_forward(a, b, A_log, dt_bias):
    t, h = a.shape
    out = torch.empty(2, t, h, dtype=torch.float32, device=a.device)  # [g, beta]
    if a.numel():
        a = a if a.stride(-1) == 1 else a.contiguous()
        b = b if b.stride(-1) == 1 else b.contiguous()
        _gates_kernel[(triton.cdiv(a.numel(), tuning.ELEM_BLOCK),)](
            a, b, A_log.contiguous(), dt_bias.contiguous(), out[0], out[1], a.numel(), h, a.stride(0), b.stride(0),
            BLOCK=tuning.ELEM_BLOCK,
        )  # fmt: skip
    return out


def _gates_plain(a, b, A_log, dt_bias):
    return torch.stack(native.gdn_gates(a, b, A_log, dt_bias))


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp64 inside) and ``beta = sigmoid(b)``; elementwise."""
    if a.shape != b.shape or a.dim() != 2 or A_log.shape != (a.shape[1],) or dt_bias.shape != (a.shape[1],):
        raise ValueError(
            f"gdn_gates: a{tuple(a.shape)} b{tuple(b.shape)} must be [T, Hv] and A_log{tuple(A_log.shape)} "
            f"dt_bias{tuple(dt_bias.shape)} [Hv]"
        )
    out = with_plain_backward(_gates_forward, _gates_plain, a, b, A_log, dt_bias)
    return out[0], out[1]
