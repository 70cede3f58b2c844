"""Row-norm backward in Triton (GPU correctness profile): RMSNorm (plain, zero-centred, gated) and GDN's l2norm.

The forward of these norms is the invariant kernel; the backward only has to be deterministic. Differentiating the
plain torch form costs ~15-20 fp32 passes over [rows, hidden] per call (casts, pow, mean, rsqrt, the products and
their autograd nodes); this is one pass that reads x, dy (and the gate) and writes dx (and dgate).

Math, fp32, per row of n values (``S = sum(x^2)``; ``inv_n = 1/n`` for RMSNorm, 1 for l2norm):
    r = 1 / sqrt(S * inv_n + eps);  xhat = x * r;  y = xhat * w_eff * silu(g)
    u = dy * silu(g) * w_eff;       dx = r * (u - xhat * sum(u * xhat) * inv_n)
    dw = sum over rows of dy * silu(g) * xhat;   dg = dy * xhat * w_eff * silu'(g)
with ``w_eff = w`` (or ``1 + w`` zero-centred; 1 for l2norm) and ``silu(g) = 1`` ungated.

Deterministic: each program owns a fixed block of rows (``ROWS_PER_PROG``, from the hidden size only) and writes
its partial weight gradient; the partials are summed in one fixed-shape reduction. No atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 8192


def _tiles(hidden: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_R, ROWS_PER_PROG, warps) from the hidden size alone."""
    block_h = triton.next_power_of_2(hidden)
    block_r = max(1, min(64, 4096 // block_h))
    rows_per_prog = max(block_r, 16384 // block_h)
    return block_h, block_r, rows_per_prog, 4 if block_h * block_r <= 4096 else 8


@triton.jit
def _row_norm_bwd_kernel(
    x_ptr, g_ptr, w_ptr, dy_ptr, dx_ptr, dg_ptr, dwp_ptr, R, H, eps, inv_n,
    HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr, GATED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, ROWS_PER_PROG: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    if HAS_WEIGHT:
        b_w = tl.load(w_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            b_w = 1.0 + b_w
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(0, ROWS_PER_PROG, BLOCK_R):
        o_r = i_p * ROWS_PER_PROG + i + tl.arange(0, BLOCK_R)
        m = (o_r < R)[:, None] & m_h[None, :]
        o = o_r[:, None] * H + o_h[None, :]
        b_x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32)
        b_dy = tl.load(dy_ptr + o, mask=m, other=0.0).to(tl.float32)
        b_r = 1.0 / tl.sqrt_rn(tl.sum(b_x * b_x, axis=1) * inv_n + eps)
        b_xhat = b_x * b_r[:, None]
        if GATED:
            b_g = tl.load(g_ptr + o, mask=m, other=0.0).to(tl.float32)
            b_s = 1.0 / (1.0 + tl.exp(-b_g))
            b_dys = b_dy * (b_g * b_s)
            b_y = b_xhat * b_w if HAS_WEIGHT else b_xhat
            b_dg = b_dy * b_y * (b_s + b_g * b_s * (1.0 - b_s))
            tl.store(dg_ptr + o, b_dg.to(dg_ptr.dtype.element_ty), mask=m)
        else:
            b_dys = b_dy
        b_u = b_dys * b_w if HAS_WEIGHT else b_dys
        b_c = tl.sum(b_u * b_xhat, axis=1) * inv_n
        b_dx = b_r[:, None] * (b_u - b_xhat * b_c[:, None])
        tl.store(dx_ptr + o, b_dx.to(dx_ptr.dtype.element_ty), mask=m)
        if HAS_WEIGHT:
            b_dw += tl.sum(b_dys * b_xhat, axis=0)
    if HAS_WEIGHT:
        tl.store(dwp_ptr + i_p * H + o_h, b_dw, mask=m_h)


def row_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    gate: torch.Tensor | None,
    eps: float,
    *,
    mean: bool = True,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dgate)`` of ``x̂ * w_eff * silu(gate)`` over the last dim (module docstring).

    ``mean``: RMSNorm's mean of squares (False: l2norm's sum). ``weight``/``gate`` None: absent, and so is their
    gradient. dx in x's dtype, dgate in the gate's, dweight in the weight's (summed in fp32)."""
    h = x.shape[-1]
    if h > MAX_HIDDEN:
        raise ValueError(f"row_norm_backward: hidden size {h} > {MAX_HIDDEN} (one row block per program)")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"row_norm_backward: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    x2 = x.reshape(-1, h).contiguous()
    dy2 = dy.reshape(-1, h).contiguous()
    g2 = gate.reshape(-1, h).contiguous() if gate is not None else x2
    rows = x2.shape[0]
    block_h, block_r, rows_per_prog, warps = _tiles(h)
    progs = triton.cdiv(rows, rows_per_prog)
    dx = torch.empty_like(x2)
    dg = torch.empty_like(g2) if gate is not None else None
    dwp = torch.empty(progs, h, dtype=torch.float32, device=x.device) if weight is not None else None
    if rows:
        _row_norm_bwd_kernel[(progs,)](
            x2, g2, weight if weight is not None else x2, dy2, dx, dg if dg is not None else dx,
            dwp if dwp is not None else dx, rows, h, float(eps), 1.0 / h if mean else 1.0,
            HAS_WEIGHT=weight is not None, ZERO_CENTERED=zero_centered, GATED=gate is not None,
            BLOCK_H=block_h, BLOCK_R=block_r, ROWS_PER_PROG=rows_per_prog, num_warps=warps,
        )  # fmt: skip
    dw = None
    if weight is not None:
        dw = (dwp.sum(0) if rows else torch.zeros(h, dtype=torch.float32, device=x.device)).to(weight.dtype)
    return dx.reshape(x.shape), dw, None if dg is None else dg.reshape(x.shape)


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``rms_norm(x, weight)`` for :func:`~megatron_iso.ops.common.autograd.with_fused_backward`."""
    dx, dw, _ = row_norm_backward(dy, x, weight, None, eps, zero_centered=zero_centered)
    return dx, dw


def gated_rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``gated_rms_norm(x, gate, weight)`` (x, gate, weight order)."""
    dx, dw, dg = row_norm_backward(dy, x, weight, gate, eps, zero_centered=zero_centered)
    return dx, dg, dw


def l2norm_backward(dy: torch.Tensor, x: torch.Tensor, eps: float) -> tuple[torch.Tensor, None]:
    """Gradient of GDN's fp32 ``x / sqrt(sum(x^2) + eps)`` (dx in x's dtype; eps gets none)."""
    dx, _, _ = row_norm_backward(dy, x, None, None, eps, mean=False)
    return dx, None
