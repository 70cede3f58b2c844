"""The correctness profile's MoE slot bookkeeping without autograd, one launch each: the expert-major order of a
step's (token, expert) slots and the routed combine with the shared expert, with the torch path's bits.

Why: around the grouped expert GEMMs the dispatcher spends about ten small torch kernels per MoE layer (a radix
sort, the inverse permutation's fill and scatter, a row gather, the products, the tree levels over k, the shared
expert's widening and add, the rounding). A decode step runs them for a few dozen tokens per layer.

- :func:`slot_order_triton`: ``order`` is what a stable sort of the slots' expert ids returns (a slot's rank is the
  number of slots with a lower id, plus those with its id earlier in the list: integer counts, exact in any
  order), and ``inverse`` its inverse permutation. Every program compares its slots with all others, so the work
  grows as ``S^2``: up to :data:`MAX_SLOTS` slots (decode steps, short prefills); longer lists take the sort.
- :func:`combine_triton`: per token, ``round(tree_k(w_k * y[inverse[n k + k']]) + shared)``: the fp32 products,
  the fixed tree over k (adjacent pairs), the fp32 add of the shared expert and one rounding, the torch path's
  operations in its order (compiled without FMA, so no product is fused into a tree add).
- :func:`combine_backward_triton`: its backward in one pass per token, reading the expert rows where they lie
  (the torch path's autograd keeps a gathered fp32 copy of them and makes several passes): ``dy`` of a slot is
  ``w * dout`` (the torch product's bits), written at the slot's expert-major row; ``dw`` of a slot is
  ``sum_h y * dout`` over H in a fixed order (blocks of H in sequence, then the fixed tree): deterministic, not
  the torch reduction's bits (no trainer gradient is compared across implementations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.ieee_math_triton import NO_FMA, f32_to, to_f32
from megatron_iso.ops.common.interpret import INTERPRET
from megatron_iso.ops.common.tree_triton import fixed_tree_rowsum

MAX_SLOTS = 8192
_SLOT_BLOCK = 128
_COMBINE_BLOCK_H = 256
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda or INTERPRET


def serves_order(flat: torch.Tensor) -> bool:
    """Whether :func:`slot_order_triton` computes the order of these expert ids (1-D int64, on CUDA)."""
    return flat.dim() == 1 and flat.dtype == torch.int64 and _on_device(flat) and 0 < flat.numel() <= MAX_SLOTS


def serves_combine(expert_out: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, dtype) -> bool:
    """Whether :func:`combine_triton` (and, under autograd, :func:`combine_backward_triton`) computes this combine:
    fp32 expert rows and weights, k a power of two up to 16, on CUDA."""
    k = weights.shape[-1] if weights.dim() == 2 else 0
    return (
        _on_device(expert_out)
        and expert_out.dim() == 2
        and expert_out.dtype == torch.float32
        and weights.dtype == torch.float32
        and 1 <= k <= 16
        and not k & (k - 1)
        and dtype in _OUT_DTYPES
        and (shared is None or (shared.dtype in _OUT_DTYPES and shared.shape[-1] == expert_out.shape[1]))
    )


@triton.jit
def _slot_order_kernel(
    flat_ptr, order_ptr, inverse_ptr, source_ptr, n_slots, TOPK, WRITE_SOURCE: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Each slot's rank among all slots (lower id, or the same id earlier); ``WRITE_SOURCE``: also the token each
    position of the order copies (slot ``i`` is token ``i // TOPK``'s)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_slots
    mine = tl.load(flat_ptr + i, mask=live, other=0)
    rank = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, n_slots, BLOCK):
        j = start + tl.arange(0, BLOCK)
        theirs = tl.load(flat_ptr + j, mask=j < n_slots, other=0)
        lower = theirs[None, :] < mine[:, None]
        tie_before = (theirs[None, :] == mine[:, None]) & (j[None, :] < i[:, None])
        rank += tl.sum(((lower | tie_before) & (j[None, :] < n_slots)).to(tl.int32), axis=1)
    tl.store(inverse_ptr + i, rank.to(tl.int64), mask=live)
    tl.store(order_ptr + rank, i.to(tl.int64), mask=live)
    if WRITE_SOURCE:
        tl.store(source_ptr + rank, (i // TOPK).to(tl.int64), mask=live)


def slot_order_triton(flat: torch.Tensor, topk: int | None = None) -> tuple[torch.Tensor, ...]:
    """``(order, inverse)`` of the slots' expert ids ``flat [S]``: ``torch.sort(flat, stable=True).indices`` and
    the permutation with ``inverse[order] = arange(S)``; with ``topk``, also ``order // topk`` (the token each
    expert-major row copies), from the same launch."""
    if not serves_order(flat):
        raise ValueError(f"slot_order_triton: 1-D int64 ids on CUDA, 1 .. {MAX_SLOTS} of them; got {tuple(flat.shape)}")
    flat = flat.contiguous()
    order, inverse = torch.empty_like(flat), torch.empty_like(flat)
    source = torch.empty_like(flat) if topk else order
    s = flat.numel()
    _slot_order_kernel[(triton.cdiv(s, _SLOT_BLOCK),)](
        flat, order, inverse, source, s, topk or 1, WRITE_SOURCE=bool(topk), BLOCK=_SLOT_BLOCK, num_warps=4
    )  # fmt: skip
    return (order, inverse, source) if topk else (order, inverse)


@triton.jit
def _combine_kernel(
    y_ptr, inverse_ptr, w_ptr, shared_ptr, out_ptr, H, K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = h < H
    slots = tl.arange(0, K)
    rows = tl.load(inverse_ptr + n * K + slots)
    w = tl.load(w_ptr + n * K + slots)
    y = tl.load(y_ptr + rows[:, None] * H + h[None, :], mask=live[None, :], other=0.0)
    terms = tl.trans(y * w[:, None])  # [BLOCK_H, K]: one rounding per product
    if K == 1:  # noqa: SIM108 - a constexpr branch: Triton compiles only the chosen one
        acc = tl.reshape(terms, (BLOCK_H,))
    else:
        acc = fixed_tree_rowsum(terms, BLOCK_H, K)
    if HAS_SHARED:
        acc = acc + to_f32(tl.load(shared_ptr + n * H + h, mask=live, other=0.0))
    tl.store(out_ptr + n * H + h, f32_to(acc, out_ptr.dtype.element_ty), mask=live)


def combine_triton(
    expert_out: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[N, H]`` in ``dtype``: token n's slots ``expert_out[inverse[n k + j]]`` (fp32, ``[S, H]``) weighted by
    ``weights [N, k]`` and summed by the fixed tree over k, plus ``shared [N, H]`` widened to fp32, rounded once."""
    if not serves_combine(expert_out, weights, shared, dtype):
        raise ValueError("combine_triton: fp32 [S, H] rows and [N, k] weights (k a power of two <= 16) on CUDA")
    n, k = weights.shape
    h = expert_out.shape[1]
    out = torch.empty((n, h), dtype=dtype, device=expert_out.device)
    if n and h:
        shared_rows = shared.reshape(n, h).contiguous() if shared is not None else out
        _combine_kernel[(n, triton.cdiv(h, _COMBINE_BLOCK_H))](
            expert_out.contiguous(),
            inverse.contiguous(),
            weights.contiguous(),
            shared_rows,
            out,
            h,
            K=k,
            HAS_SHARED=shared is not None,
            BLOCK_H=_COMBINE_BLOCK_H,
            num_warps=4,
            **NO_FMA,
        )
    return out


@triton.jit
def _combine_backward_kernel(
    dout_ptr, y_ptr, inverse_ptr, w_ptr, dy_ptr, dw_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr
):
    n = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K)
    rows = tl.load(inverse_ptr + n * K + slots)
    w = tl.load(w_ptr + n * K + slots)
    acc = tl.zeros((K, BLOCK_H), dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        live = h < H
        d = to_f32(tl.load(dout_ptr + n * H + h, mask=live, other=0.0))
        at = rows[:, None] * H + h[None, :]
        y = tl.load(y_ptr + at, mask=live[None, :], other=0.0)
        tl.store(dy_ptr + at, d[None, :] * w[:, None], mask=live[None, :])
        acc += y * d[None, :]
    tl.store(dw_ptr + n * K + slots, fixed_tree_rowsum(acc, K, BLOCK_H))


def combine_backward_triton(
    grad_out: torch.Tensor,
    expert_out: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor | None, None]:
    """Gradients of :func:`combine_triton` for ``ops.common.autograd.with_fused_backward``: ``(d expert_out [S, H]
    fp32, None, d weights [N, k] fp32, d shared (the output gradient widened to fp32, in shared's dtype), None)``."""
    n, k = weights.shape
    h = expert_out.shape[1]
    grad_out = grad_out.reshape(n, h).contiguous()
    d_rows = torch.empty_like(expert_out)  # every row is some slot's: the permutation covers them all
    d_weights = torch.empty_like(weights)
    if n and h:
        block_h = max(16, min(_COMBINE_BLOCK_H, 4096 // k))
        _combine_backward_kernel[(n,)](
            grad_out,
            expert_out.contiguous(),
            inverse.contiguous(),
            weights.contiguous(),
            d_rows,
            d_weights,
            h,
            K=k,
            BLOCK_H=block_h,
            num_warps=4,
            **NO_FMA,
        )
    elif not h:
        d_weights.zero_()
    d_shared = None if shared is None else grad_out.float().to(shared.dtype).reshape(shared.shape)
    return d_rows, None, d_weights, d_shared, None
