"""The fixed reduction tree inside a Triton program (see :mod:`megatron_iso.ops.common.tree`).

``tl.sum`` reduces in an order set by how a tensor's registers are spread over threads, which changes
with the block shape, ``num_warps`` and the compiler's layout choices. :func:`fixed_tree_rowsum` adds
adjacent pairs level by level through ``reshape``/``split`` instead: every add is named by the
column indices alone, so a row's sum has the same bits under any layout or launch config. For N a
power of two it is the order of ``tree.tree_sum_dim`` over the columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_TREE_COLUMNS = 1024  # the deepest tree fixed_tree_rowsum spells out


@triton.jit
def pair_sum(x, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """``x [BLOCK_M, W]`` -> ``[BLOCK_M, W // 2]``: column 2j plus column 2j + 1."""
    a, b = tl.split(tl.reshape(x, (BLOCK_M, W // 2, 2)))
    return a + b  # one rounding per pair, commutative: the same bits in any register layout


@triton.jit
def fixed_tree_rowsum(x, BLOCK_M: tl.constexpr, N: tl.constexpr):
    """Row sums ``[BLOCK_M]`` of ``x [BLOCK_M, N]`` (N a power of two, 2 <= N <= :data:`MAX_TREE_COLUMNS`) by
    the fixed binary tree over the N columns, adjacent pairs first. The levels are written out: each
    halves the tensor's shape, which a loop-carried value cannot do."""
    x = pair_sum(x, BLOCK_M, N)
    if N >= 4:
        x = pair_sum(x, BLOCK_M, N // 2)
    if N >= 8:
        x = pair_sum(x, BLOCK_M, N // 4)
    if N >= 16:
        x = pair_sum(x, BLOCK_M, N // 8)
    if N >= 32:
        x = pair_sum(x, BLOCK_M, N // 16)
    if N >= 64:
        x = pair_sum(x, BLOCK_M, N // 32)
    if N >= 128:
        x = pair_sum(x, BLOCK_M, N // 64)
    if N >= 256:
        x = pair_sum(x, BLOCK_M, N // 128)
    if N >= 512:
        x = pair_sum(x, BLOCK_M, N // 256)
    if N >= 1024:
        x = pair_sum(x, BLOCK_M, N // 512)
    return tl.reshape(x, (BLOCK_M,))


__all__ = ["MAX_TREE_COLUMNS", "fixed_tree_rowsum", "pair_sum"]
