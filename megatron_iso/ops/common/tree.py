"""The fixed reduction tree: the one place that decides the order in which floats are added.

Every invariant reduction in the package (GEMM leaves, TP partials, vocab log-sum-exp leaves,
attention key blocks) adds its terms with these functions, so "the tree" is a single concept.

Shape of the tree for n terms: split at h = n // 2 (left = lower indices), recurse, add
``left + right``. For n a power of two this is the balanced binary tree; a contiguous,
aligned block of 2^j terms is always a subtree, which is what makes a rank's partial sum a node
of the global tree (TP invariance). Only elementwise adds are used, and an elementwise add of two
tensors rounds each element once, independent of the tensor's shape: results are batch invariant
by construction.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


def tree_sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum equally shaped tensors with the fixed balanced tree (left operand = lower indices)."""
    if len(terms) == 0:
        raise ValueError("tree_sum needs at least one term")
    if len(terms) == 1:
        return terms[0]
    h = len(terms) // 2
    return tree_sum(terms[:h]) + tree_sum(terms[h:])


@functools.lru_cache(maxsize=64)
def _plan(n: int, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The tree over ``n`` terms as levels of a complete binary tree of depth ``ceil(log2 n)``.

    Returns the term index of every bottom slot (a node of one term, carried down unchanged; empty
    slots read term 0 and are never added) and, per level from the bottom up, a mask of the nodes
    that have a right child (None: all of them do). A node without a right child is a single term
    passed up as is, so every add is exactly one of the recursive tree's adds.
    """
    nodes = [(0, n)]
    has_right: list[list[bool]] = []
    while any(size > 1 for _, size in nodes):
        has_right.append([size > 1 for _, size in nodes])
        children = []
        for start, size in nodes:
            h = size // 2 if size > 1 else size
            children += [(start, h), (start + h, size - h)]
        nodes = children
    bottom = torch.tensor([start if size else 0 for start, size in nodes], dtype=torch.long, device=device)
    masks = [None if all(m) else torch.tensor(m, device=device) for m in reversed(has_right)]
    return bottom, masks


def tree_sum_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Reduce ``dim`` of ``x`` with the fixed tree, level by level (about log2(n) elementwise adds).

    Equivalent, bit for bit, to ``tree_sum(x.unbind(dim))``: a power of two adds adjacent pairs; any
    other n is laid out on the complete binary tree of :func:`_plan` (one gather, then per level an
    add of the even and odd slots, keeping the lone left term where a node has no right child).
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        raise ValueError("tree_sum_dim over an empty dimension")
    if n & (n - 1):
        bottom, masks = _plan(n, x.device)
        x = x.index_select(dim, bottom)
    else:
        masks = [None] * (n.bit_length() - 1)
    idx = [slice(None)] * x.dim()
    even, odd = list(idx), list(idx)
    even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
    even, odd = tuple(even), tuple(odd)
    shape = [1] * x.dim()
    for mask in masks:
        left, right = x[even], x[odd]
        if mask is None:
            x = left + right
        else:
            shape[dim] = mask.numel()
            x = torch.where(mask.view(shape), left + right, left)
    return x.squeeze(dim)
