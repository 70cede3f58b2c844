"""Leaf-tree linear, torch reference path: batch and TP invariant by construction on any device.

``y[m, n] = sum_k x[m, k] * w[n, k]`` with the contraction dimension K cut into ``leaves``
contiguous equal leaves. Each leaf is summed with the fixed tree (``ops.common.tree``), then the leaf
sums are combined with the same balanced tree. Only elementwise fp32 multiplies and adds are
used, and an elementwise op rounds each element once whatever the tensor's shape, so a row's
result can depend on nothing but that row (batch invariance). ``torch.matmul`` is not used on
purpose: on CPU its blocking and reduction order may depend on M.

TP invariance: at TP=C rank i holds K columns [iK/C, (i+1)K/C), i.e. leaves [iG/C, (i+1)G/C).
Called with ``leaves // C`` it returns the node of the global tree over those leaves, in fp32
(never rounded here); ``parallel.tree_collectives.tree_all_reduce`` finishes the tree.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.tree import tree_sum_dim

DEFAULT_LEAVES = 8
# Upcasting these to fp32 is exact, so the fp32 products are the exact-input products.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Max elements of one fp32 product block [leaves, leaf, rows, cols] (4 MiB, cache friendly). Chunking rows or
# columns never changes any element's arithmetic; it only bounds memory.
_BLOCK_ELEMENTS = 1 << 20


def validate_leaves(leaves: int, k: int | None = None, tp: int = 1) -> None:
    """Raise ValueError naming the value if ``leaves``/``k``/``tp`` break the leaf-tree rules.

    Rules: leaves is a power of two; K is divisible by leaves; the TP degree divides leaves (so
    every rank owns a whole subtree), which for a power-of-two leaves means TP <= leaves.
    """
    if isinstance(leaves, bool) or not isinstance(leaves, int) or leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"leaves={leaves!r} must be a power of two >= 1")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"TP degree {tp!r} must be a positive int")
    if tp > leaves:
        raise ValueError(f"TP degree {tp} exceeds leaves={leaves}: each rank must own at least one whole leaf")
    if leaves % tp:
        raise ValueError(f"TP degree {tp} does not divide leaves={leaves}: a rank's leaves must form a subtree")
    if k is not None and k % leaves:
        raise ValueError(f"K={k} is not divisible by leaves={leaves}")


def check_dtype(t: torch.Tensor, name: str) -> None:
    """Raise TypeError if ``t`` cannot be upcast to fp32 exactly (or is not floating point)."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has unsupported dtype {t.dtype}; supported: {[str(d) for d in SUPPORTED_DTYPES]}")


def _check(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> None:
    check_dtype(x, "x")
    check_dtype(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K] (Megatron layout [out, in]), got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[-1]} but weight [N, K] has K={weight.shape[1]}")
    validate_leaves(leaves, k=weight.shape[1])


def leaf_tree_linear_forward(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """The kernel (no autograd): fp32 ``x @ weight.T`` evaluated as the leaf tree. Returns [..., N]."""
    _check(x, weight, leaves)
    n, k = weight.shape
    x2 = x.reshape(-1, k).float()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    leaf = k // leaves
    # K leading: the tree's even/odd slices are then whole [rows, cols] blocks, cheap to add.
    wt = weight.float().t().contiguous().reshape(leaves, leaf, 1, n)
    cols = n if k * n <= _BLOCK_ELEMENTS else max(1, _BLOCK_ELEMENTS // k)
    rows = max(1, _BLOCK_ELEMENTS // (k * cols))
    for r0 in range(0, m, rows):
        xr = x2[r0 : r0 + rows].t().reshape(leaves, leaf, -1, 1)
        for c0 in range(0, n, cols):
            prod = xr * wt[..., c0 : c0 + cols]  # [leaves, leaf, rows, cols], one rounding each
            leaf_sums = tree_sum_dim(prod, 1) if leaf > 1 else prod.squeeze(1)
            out[r0 : r0 + rows, c0 : c0 + cols] = tree_sum_dim(leaf_sums, 0) if leaves > 1 else leaf_sums.squeeze(0)
    return out.reshape(*x.shape[:-1], n)


def _weight_grad(g_t: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g_t @ x`` (operands in their own dtype) accumulated in fp32, returned in ``dtype``. On CUDA the fp32
    output is asked of the library, so a long reduction it splits is never summed in 16 bits; CPU libraries
    accumulate 16-bit products in fp32 and round the result once."""
    if g_t.is_cuda and g_t.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(g_t, x, out_dtype=torch.float32).to(dtype)
    return (g_t @ x).to(dtype)


def linear_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    need_x: bool = True,
    need_w: bool = True,
    fp32_weight_grad: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``y = x @ weight.T`` (weight [N, K]): deterministic, not invariant.

    The operands are taken in the weight's dtype, as the library GEMM of a stock trainer does: a bf16
    model's backward runs bf16 x bf16 products with fp32 accumulation on tensor cores and makes no fp32
    copy of a weight or an activation (only ``grad_out`` is cast, once, when it arrives as fp32). The
    weight gradient is accumulated over all rows in fp32 and rounded once to the weight's dtype. For a
    given shape the library picks one kernel and one reduction order, so the same inputs give the same
    bits on every call; a different row count may give different bits (the backward is not part of the
    invariance contract). ``fp32_weight_grad``: return the weight gradient unrounded (fp32), for a caller
    that sums it over row chunks before rounding once.
    """
    n, k = weight.shape
    compute = weight.dtype
    g2 = grad_out.reshape(-1, n).to(compute)
    grad_x = grad_w = None
    if need_x:
        grad_x = (g2 @ weight).to(x.dtype).reshape(x.shape)
    if need_w:
        out_dtype = torch.float32 if fp32_weight_grad else weight.dtype
        grad_w = _weight_grad(g2.t(), x.reshape(-1, k).to(compute), out_dtype)
    return grad_x, grad_w


class _LeafTreeLinear(torch.autograd.Function):
    """Invariant forward via ``kernel``; backward is :func:`linear_backward` (deterministic, not invariant)."""

    @staticmethod
    def forward(ctx, x, weight, leaves, kernel):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return kernel(x, weight, leaves)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x, grad_w = linear_backward(grad_out, x, weight, need_x=need_x, need_w=need_w)
        return grad_x, grad_w, None, None


def apply_with_matmul_backward(kernel, x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """Run an invariant forward ``kernel(x, weight, leaves)`` with a deterministic matmul backward."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LeafTreeLinear.apply(x, weight, leaves, kernel)
    return kernel(x, weight, leaves)


def leaf_tree_linear(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 ``x @ weight.T`` (weight [N, K]) as the leaf tree; differentiable. Returns fp32 [..., N]."""
    return apply_with_matmul_backward(leaf_tree_linear_forward, x, weight, leaves)
