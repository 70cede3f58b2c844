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


def tree_sum_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Reduce ``dim`` of ``x`` with the fixed tree; vectorised: log2(n) elementwise adds of halves.

    Equivalent, bit for bit, to ``tree_sum(x.unbind(dim))``.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        raise ValueError("tree_sum_dim over an empty dimension")
    if n == 1:
        return x.squeeze(dim)
    if n & (n - 1) == 0:  # power of two: adding adjacent pairs level by level is the balanced tree
        idx = [slice(None)] * x.dim()
        while x.shape[dim] > 1:
            even, odd = list(idx), list(idx)
            even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
            x = x[tuple(even)] + x[tuple(odd)]
        return x.squeeze(dim)
    h = n // 2
    return tree_sum_dim(x.narrow(dim, 0, h), dim) + tree_sum_dim(x.narrow(dim, h, n - h), dim)
