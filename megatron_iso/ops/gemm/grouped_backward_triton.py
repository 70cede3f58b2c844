"""The grouped expert GEMM's backward in Triton: every expert's gradients in two launches, no host sync.

The forward (``grouped_triton``) is invariant; the backward need only be deterministic (DESIGN.md). The per-expert
loop of library GEMMs it replaces costs 2 launches, 2 casts and a copy per expert and needs the counts on the host;
at 128 experts the trainer is bound by those launches. Here, for ``y_e = x_e @ w_e.T`` (rows sorted by expert,
``counts[e]`` each, read on the device):

- ``dgrad``: ``grad_x[rows of e] = g[rows of e] @ w_e`` -- one program per (expert M-tile, K-tile), the M-tiles
  found from the counts' prefix sums as the forward finds them; contraction over N in ``BLOCK_N`` steps.
- ``wgrad``: ``grad_w[e] = g[rows of e].T @ x[rows of e]`` -- one program per (expert, N-tile, K-tile), the
  expert's rows contracted in ``BLOCK_M`` steps in increasing order; an expert without rows gets zeros.

Both accumulate in fp32 and round once to the operands' dtype, as ``reference.linear_backward`` does. Tiles are
fixed per dtype (no autotuning: another tile would be another summation order), so the same inputs give the same
bits on every call; the bits depend on the counts, as the library loop's did (the backward is outside the
invariance contract). 16-bit operands only: fp32 models keep the library loop (exact fp32 products, no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.interpret import INTERPRET as _INTERPRET
from megatron_iso.ops.gemm.grouped_triton import _expert_of_tile, m_tiles_bound, weight_table
from megatron_iso.ops.gemm.leaf_steps_triton import _dot

SUPPORTED = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BackwardTiles:
    """Fixed tiles of the two kernels (a schedule and a summation order: changing one changes gradient bits)."""

    dgrad_m: int = 128
    dgrad_n: int = 64  # contraction step
    dgrad_k: int = 128
    dgrad_warps: int = 8
    dgrad_stages: int = 3
    wgrad_n: int = 128
    wgrad_k: int = 128
    wgrad_m: int = 64  # contraction step
    wgrad_warps: int = 8
    wgrad_stages: int = 3


TILES = BackwardTiles()
INTERPRET_TILES = BackwardTiles(16, 8, 16, 4, 1, 16, 16, 8, 4, 1)


@triton.jit
def _grouped_dgrad_kernel(
    g_ptr, w_ptr, w_off_ptr, counts_ptr, out_ptr,
    T, N, K, E,
    stride_gm, stride_gn, stride_wn, stride_wk, stride_om, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    CAST_F32: tl.constexpr, E_POW2: tl.constexpr, W_ALIGN: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    e, row0, m_e, local = _expert_of_tile(counts_ptr, pid_m, T, E, BLOCK_M, E_POW2)
    if e < E:
        o_m = local * BLOCK_M + tl.arange(0, BLOCK_M)
        o_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        o_n = tl.arange(0, BLOCK_N)
        m_m = o_m < m_e
        m_k = o_k < K
        p_g = g_ptr + (row0 + o_m[:, None]) * stride_gm + o_n[None, :] * stride_gn
        w_e = w_ptr + tl.multiple_of(tl.load(w_off_ptr + e), W_ALIGN)
        p_w = w_e + o_n[:, None] * stride_wn + o_k[None, :] * stride_wk
        b_acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for n0 in tl.range(0, N, BLOCK_N, num_stages=STAGES):
            m_n = (n0 + o_n) < N
            b_g = tl.load(p_g, mask=m_m[:, None] & m_n[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0)
            b_acc = _dot(b_g, b_w, b_acc, CAST_F32, False)
            p_g += BLOCK_N * stride_gn
            p_w += BLOCK_N * stride_wn
        p_o = out_ptr + (row0 + o_m[:, None]) * stride_om + o_k[None, :] * stride_ok
        tl.store(p_o, b_acc.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_k[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    g_ptr, x_ptr, counts_ptr, out_ptr,
    T, N, K, E, K_TILES,
    stride_gm, stride_gn, stride_xm, stride_xk, stride_oe, stride_on, stride_ok,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
    CAST_F32: tl.constexpr, E_POW2: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    pid = tl.program_id(1)
    pid_n = pid // K_TILES
    pid_k = pid % K_TILES
    idx = tl.arange(0, E_POW2)
    rows = tl.maximum(tl.load(counts_ptr + idx, mask=idx < E, other=0), 0)
    ends = tl.cumsum(rows, 0)
    sel = idx == e
    start = tl.minimum(tl.sum(tl.where(sel, ends - rows, 0), 0), T).to(tl.int64)
    end = tl.minimum(tl.sum(tl.where(sel, ends, 0), 0), T).to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_m = tl.arange(0, BLOCK_M)
    m_n = o_n < N
    m_k = o_k < K
    b_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in tl.range(start, end, BLOCK_M, num_stages=STAGES):
        m_m = (m0 + o_m) < end
        p_g = g_ptr + (m0 + o_m[:, None]) * stride_gm + o_n[None, :] * stride_gn
        p_x = x_ptr + (m0 + o_m[:, None]) * stride_xm + o_k[None, :] * stride_xk
        b_g = tl.load(p_g, mask=m_m[:, None] & m_n[None, :], other=0.0)
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_acc = _dot(tl.trans(b_g), b_x, b_acc, CAST_F32, False)
    p_o = out_ptr + e.to(tl.int64) * stride_oe + o_n[:, None] * stride_on + o_k[None, :] * stride_ok
    tl.store(p_o, b_acc.to(out_ptr.dtype.element_ty), mask=m_n[:, None] & m_k[None, :])


def grouped_backward_supported(x: torch.Tensor, ws: list[torch.Tensor]) -> bool:
    """Whether :func:`grouped_linear_backward_triton` serves these operands (16-bit, on CUDA or interpreted)."""
    return x.dtype in SUPPORTED and ws[0].dtype == x.dtype and (x.is_cuda or _INTERPRET)


def grouped_linear_backward_triton(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    ws: list[torch.Tensor],
    counts: torch.Tensor,
    *,
    need_x: bool = True,
    need_w: bool = True,
    tiles: BackwardTiles | None = None,
    wgrad: str = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x [T, K] in x's dtype, grad_w [E, N, K] in the weights' dtype)`` of ``y[rows of e] = x[rows of e] @
    ws[e].T``; either is None when not needed. ``grad_out`` [T, N] (any float dtype: cast once to the operands').
    ``wgrad``: ``"triton"`` (the kernel below), ``"grouped_mm"`` (torch's CUTLASS grouped GEMM) or ``"auto"``
    (:func:`wgrad_backend`)."""
    if wgrad not in WGRAD_BACKENDS:
        raise ValueError(f"grouped_linear_backward_triton: wgrad={wgrad!r}; allowed: {sorted(WGRAD_BACKENDS)}")
    tiles = tiles or (INTERPRET_TILES if _INTERPRET else TILES)
    t, k = x.shape
    n = ws[0].shape[0]
    e = len(ws)
    g = grad_out.reshape(t, n).to(x.dtype)
    counts = counts.to(x.device, non_blocking=True)
    cast = _INTERPRET and x.dtype != torch.float32
    e_pow2 = triton.next_power_of_2(e)
    grad_x = grad_w = None
    if need_x:
        grad_x = torch.empty_like(x)
        if t and k:
            table, aligned = weight_table(ws)
            stride_wn, stride_wk = ws[0].stride()
            grid = (m_tiles_bound(t, e, tiles.dgrad_m), triton.cdiv(k, tiles.dgrad_k))
            _grouped_dgrad_kernel[grid](
                g, ws[0], table, counts, grad_x,
                t, n, k, e,
                g.stride(0), g.stride(1), stride_wn, stride_wk, grad_x.stride(0), grad_x.stride(1),
                BLOCK_M=tiles.dgrad_m, BLOCK_N=tiles.dgrad_n, BLOCK_K=tiles.dgrad_k, STAGES=tiles.dgrad_stages,
                CAST_F32=cast, E_POW2=e_pow2, W_ALIGN=16 // ws[0].element_size() if aligned else 1,
                num_warps=tiles.dgrad_warps,
            )  # fmt: skip
    if need_w and (wgrad_backend(x) if wgrad == "auto" else wgrad) == "grouped_mm":
        grad_w = grouped_mm_wgrad(g, x, counts, e)
    elif need_w:
        grad_w = torch.empty((e, n, k), device=x.device, dtype=ws[0].dtype)
        if n and k:
            k_tiles = triton.cdiv(k, tiles.wgrad_k)
            grid = (e, triton.cdiv(n, tiles.wgrad_n) * k_tiles)
            _grouped_wgrad_kernel[grid](
                g, x, counts, grad_w,
                t, n, k, e, k_tiles,
                g.stride(0), g.stride(1), x.stride(0), x.stride(1),
                grad_w.stride(0), grad_w.stride(1), grad_w.stride(2),
                BLOCK_N=tiles.wgrad_n, BLOCK_K=tiles.wgrad_k, BLOCK_M=tiles.wgrad_m, STAGES=tiles.wgrad_stages,
                CAST_F32=cast, E_POW2=e_pow2, num_warps=tiles.wgrad_warps,
            )  # fmt: skip
    return grad_x, grad_w


WGRAD_BACKENDS = frozenset({"auto", "triton", "grouped_mm"})


def wgrad_backend(x: torch.Tensor) -> str:
    """The weight gradient's kernel for operands like ``x``: torch's grouped GEMM (``torch._grouped_mm``: CUTLASS,
    one launch over all experts, no split-K, so deterministic) where this torch has it for ``x`` (bf16 on a CUDA
    device of compute capability 9.0 or newer), else the Triton kernel. Both sum each expert's rows in a fixed
    order with fp32 accumulation; their bits differ from each other (the backward is outside the invariance
    contract: deterministic is what it owes)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")) or _INTERPRET:
        return "triton"
    return "grouped_mm" if torch.cuda.get_device_capability(x.device) >= (9, 0) else "triton"


def grouped_mm_wgrad(g: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, experts: int) -> torch.Tensor:
    """``grad_w[e] = g[rows of e].T @ x[rows of e]`` ``[E, N, K]`` by ``torch._grouped_mm`` over the row groups
    (offsets: the counts' prefix sums, on the device). An expert without rows gets zeros whatever the library
    leaves in its output block."""
    offs = counts.to(torch.int32).cumsum(0, dtype=torch.int32)
    # The library takes a column-major [N, T] and a row-major [T, K] operand (no-ops for the usual dense rows).
    grad_w = torch._grouped_mm(g.contiguous().t(), x.contiguous(), offs=offs)
    return grad_w.masked_fill_((counts == 0).view(experts, 1, 1), 0)


__all__ = [
    "INTERPRET_TILES",
    "TILES",
    "BackwardTiles",
    "grouped_backward_supported",
    "grouped_linear_backward_triton",
    "grouped_mm_wgrad",
    "wgrad_backend",
]
