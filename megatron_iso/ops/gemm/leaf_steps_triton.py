"""The jit steps every leaf-tree GEMM tile loop runs (the static and flat loops of
:mod:`megatron_iso.ops.gemm.gemm_triton`, the TMA loop of :mod:`megatron_iso.ops.gemm.gemm_tma_triton`, the grouped
experts' kernel): the output tile a program takes, a leaf's K-tile dot, and the tree step of loops whose leaf index
is a run-time value. Triton inlines them, so each loop runs the very same instructions for them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order so that consecutive programs share weight tiles in L2; it changes only
    # which program computes a tile, never how.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * grid_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, CAST_F32: tl.constexpr, IEEE: tl.constexpr):
    if CAST_F32:
        # The interpreter's bf16 dot is wrong; products of bf16 values are exact in fp32 anyway.
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tree_step(
    v, s0, i, park, out, omask, stride_pl, LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, PARK_FROM: tl.constexpr
):  # fmt: skip
    """Leaf ``i``'s fp32 result ``v`` into the stack evaluation of the balanced tree, for loops whose leaf index is a
    run-time value (flat, TMA): leaf i closes one subtree per trailing one bit of i + 1, adding the lower nodes
    (level 0 from ``s0`` when ``PARK_FROM >= 1``, higher levels from the fp32 scratch ``park``) on the left; the
    last leaf stores the root at ``out``, any other parks the node it closed at the level of i's trailing ones.
    Returns the level-0 slot ``s0``."""
    if PARK_FROM >= 1:  # noqa: SIM102 - compile-time test outside, run-time test inside
        if i % 2 == 1:
            v = s0 + v
    for lvl in tl.static_range(PARK_FROM, LOG2_LEAVES):
        if (i + 1) % (2 << lvl) == 0:
            v = tl.load(park + (lvl - PARK_FROM) * stride_pl, mask=omask) + v
    if i == LEAVES - 1:
        tl.store(out, v, mask=omask)
    else:
        lvl_park = 0  # the level v parks at: the trailing ones of i
        for lvl in tl.static_range(1, LOG2_LEAVES):
            if (i + 1) % (1 << lvl) == 0:
                lvl_park = lvl
        if PARK_FROM >= 1:
            if lvl_park == 0:
                s0 = v
            else:
                tl.store(park + (lvl_park - PARK_FROM) * stride_pl, v, mask=omask)
        else:
            tl.store(park + lvl_park * stride_pl, v, mask=omask)
    return s0
