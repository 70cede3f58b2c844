"""The leaf-tree GEMM in Gluon (sm_90): one load pipeline across every leaf of a program, wgmma per leaf
(``GemmTileConfig(loop="gluon")`` of :mod:`megatron_iso.ops.gemm.gemm_triton`, the same arithmetic as its other loops).

Why it exists: Triton pipelines one loop at a time. The TMA loop (:mod:`megatron_iso.ops.gemm.gemm_tma_triton`) gives
each leaf its own K loop, so at every leaf end its load pipeline drains and the next leaf's first tiles load while
the tensor cores wait; the flat loop keeps the loads flowing but reads the accumulator inside its loop, so every
wgmma is waited for at once. Gluon states the pipeline explicitly: the TMA loads of the subtree's K tiles run
``STAGES - 1`` tiles ahead through a ring of shared-memory stages and mbarriers, across leaf boundaries; the
wgmmas are issued asynchronously with one kept in flight (a wgmma is waited for once the next one is queued behind
it, and only then is its stage refilled), and the accumulator is read only after a leaf's last wgmma, for the tree
step. Its two-leaf form (``loop="gluon_pairs"``) walks leaves 2j and 2j + 1 together, their K tiles alternating
between two accumulators: a program then stops for the accumulators and the tree step at half as many leaf ends, and
the wgmma queued behind the one in flight never waits for that one's result.

The same bits as the other loops: each leaf is ``acc = 0; acc = mma(x_k, w_k^T, acc)`` over the leaf's K tiles in
increasing order with BLOCK_K = 64 (a fresh zero accumulator, never the instruction's zero-input form, which would
differ in the sign of a zero), and the leaves' fp32 results meet in the same balanced tree
(:func:`~megatron_iso.ops.gemm.leaf_steps_triton._tree_step`; in the two-leaf form the pair's sum is the tree's
level-1 node, and the nodes above meet in the same order). Rows and columns past M and N load as zeros (TMA's
out-of-bounds fill) and are never stored. bf16 / fp16 only (fp32's exact dot is not a wgmma); TMA needs 16-byte
aligned rows (``gemm_tma_triton.tma_supported``). Gluon has no interpreter: the GPU tests hold it to the pointer
loops' bits (tests/gpu/test_gemm_tiles.py).
"""

from __future__ import annotations

import torch
import triton

from megatron_iso.ops.common.interpret import INTERPRET
from megatron_iso.ops.gemm.gemm_tma_triton import tma_supported
from megatron_iso.ops.gemm.leaf_steps_triton import _pair_k_tile, _tile_coords_of, _tree_step

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a triton without Gluon: the loop is not selectable (gluon_supported says why)
    gluon = None

_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def gluon_supported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None when the Gluon loop can run these operands, else why not (for the caller's error)."""
    if gluon is None:
        return f"triton {triton.__version__} has no triton.experimental.gluon (Hopper)"
    if INTERPRET:
        return "Gluon kernels have no interpreter (TRITON_INTERPRET=1)"
    if x.dtype not in _GL_DTYPES:
        return f"dtype {x.dtype} (the Gluon loop runs wgmma: bf16 or fp16)"
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] != 9:
        return "the Gluon loop's wgmma runs on sm_90 (Hopper), device is sm_{}{}".format(
            *torch.cuda.get_device_capability(x.device)
        )
    return tma_supported(x, weight)


if gluon is not None:

    @gluon.jit
    def _load_tile(x_desc, w_desc, bars, x_bufs, w_bufs, tile, plan, STAGES: gl.constexpr, PAIRS: gl.constexpr,
                   GROUP_M: gl.constexpr, PERSISTENT: gl.constexpr):  # fmt: skip
        """Start the TMA loads of the program's ``tile``-th K tile in consumption order into its ring stage (none past
        the last): the subtree's K order, or with ``PAIRS`` two leaves' tiles alternating (:func:`_pair_k_tile`);
        with ``PERSISTENT`` the program's output tiles one after another, the next one's loads starting while the
        current one's last wgmmas run. ``plan``: (loads in all, K tiles per output tile, the subtree's first K tile,
        this output tile's row and column offsets, K tiles per leaf, the first output tile, the output-tile stride,
        M, N)."""
        n_loads, total, first_tile, off_m, off_n, leaf_tiles, tile0, tile_step, M, N = plan
        stage = tile % STAGES
        k_tile = tile
        if PERSISTENT:
            pid_m, pid_n = _tile_coords_of(tile0 + (tile // total) * tile_step, M, N, x_desc.block_type.shape[0],
                                           w_desc.block_type.shape[0], GROUP_M)  # fmt: skip
            off_m = pid_m * x_desc.block_type.shape[0]
            off_n = pid_n * w_desc.block_type.shape[0]
            k_tile = tile % total
        if PAIRS:
            k_tile = _pair_k_tile(k_tile, leaf_tiles)
        k = (first_tile + k_tile) * x_desc.block_type.shape[1]
        ready = tile < n_loads
        bar = bars.index(stage)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=ready)
        tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_bufs.index(stage), pred=ready)
        tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, w_bufs.index(stage), pred=ready)

    @gluon.jit
    def _leaf_wgmmas(x_bufs, w_bufs, bars, x_desc, w_desc, layout: gl.constexpr, first, count, plan,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     PERSISTENT: gl.constexpr):  # fmt: skip
        """A leaf's wgmmas, K tiles ``first .. first + count - 1`` from a fresh zero accumulator, at most one left
        running: once the one before a tile's is done, that tile's stage is refilled with the tile ``STAGES - 1``
        ahead."""
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for tile in range(first, first + count):
            stage = tile % STAGES
            mbarrier.wait(bars.index(stage), (tile // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            _load_tile(x_desc, w_desc, bars, x_bufs, w_bufs, tile - 1 + STAGES, plan, STAGES, False, GROUP_M,
                       PERSISTENT)  # fmt: skip
        return acc

    @gluon.jit
    def _pair_turn(x_bufs, w_bufs, bars, x_desc, w_desc, tile, acc, other, plan, STAGES: gl.constexpr,
                   GROUP_M: gl.constexpr, PERSISTENT: gl.constexpr):  # fmt: skip
        """One turn of :func:`_pair_wgmmas`: the ``tile``-th K tile (consumption order) into ``acc`` once its loads
        landed, then a wait for the wgmma before it (``other``'s) and the refill of that one's stage."""
        stage = tile % STAGES
        mbarrier.wait(bars.index(stage), (tile // STAGES) & 1)
        acc = warpgroup_mma(x_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc, is_async=True)
        acc, other = warpgroup_mma_wait(1, deps=(acc, other))
        _load_tile(x_desc, w_desc, bars, x_bufs, w_bufs, tile - 1 + STAGES, plan, STAGES, True, GROUP_M, PERSISTENT)
        return acc, other

    @gluon.jit
    def _pair_wgmmas(x_bufs, w_bufs, bars, x_desc, w_desc, layout: gl.constexpr, first, leaf_tiles, plan,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     PERSISTENT: gl.constexpr):  # fmt: skip
        """Two consecutive leaves' wgmmas, their K tiles alternating (``first + 2t``: the first leaf's tile t, ``first
        + 2t + 1``: the second's), each leaf into its own fresh zero accumulator and in its own K order: the same
        two sums as two :func:`_leaf_wgmmas` calls. One wgmma is kept in flight as there, but the one queued behind
        it never needs its result (it adds into the other leaf's accumulator)."""
        acc_a = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        acc_b = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for t in range(leaf_tiles):
            acc_a, acc_b = _pair_turn(x_bufs, w_bufs, bars, x_desc, w_desc, first + 2 * t, acc_a, acc_b, plan,
                                      STAGES, GROUP_M, PERSISTENT)  # fmt: skip
            acc_b, acc_a = _pair_turn(x_bufs, w_bufs, bars, x_desc, w_desc, first + 2 * t + 1, acc_b, acc_a, plan,
                                      STAGES, GROUP_M, PERSISTENT)  # fmt: skip
        return acc_a, acc_b

    @gluon.jit
    def _tile_setup(it, tile0, tile_step, my_tiles, sub, first_tile, total, leaf_tiles, out_ptr, park_ptr, M, N,
                    stride_op, stride_om, stride_ps, layout: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
        """The program's ``it``-th output tile (``tile0 + it * tile_step`` of the grid's, subtree ``sub``): its output
        and park pointers in the accumulator's layout, the mask of its elements inside M x N, and the load ``plan``
        of :func:`_load_tile`."""
        pid_m, pid_n = _tile_coords_of(tile0 + it * tile_step, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        omask = (rm[:, None] < M) & (rn[None, :] < N)
        o_off = rm.to(gl.int64)[:, None] * stride_om + rn[None, :]
        park = park_ptr + sub * stride_ps + o_off
        plan = (my_tiles * total, total, first_tile, off_m, off_n, leaf_tiles, tile0, tile_step, M, N)
        return out_ptr + sub * stride_op + o_off, park, omask, plan

    @gluon.jit
    def _output_tile(x_bufs, w_bufs, bars, x_desc, w_desc, first, plan, out, park, omask, stride_pl,
                     layout: gl.constexpr, LEAVES: gl.constexpr, LOG2_LEAVES: gl.constexpr, PARK_FROM: gl.constexpr,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, PAIRS: gl.constexpr,
                     PERSISTENT: gl.constexpr):  # fmt: skip
        """One output tile: its leaves' wgmmas from the program's ``first``-th K tile in consumption order (loads
        as ``plan`` says, :func:`_load_tile`), and their tree into ``out`` (parked levels at ``park``)."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        leaf_tiles = plan[5]
        s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        if PAIRS:
            # Leaves 2j and 2j + 1 together: their sum is the tree's level-1 node j, and the nodes above it meet as
            # the leaves' tree would meet them (a balanced tree of LEAVES / 2 nodes, every level parked).
            for j in range(LEAVES // 2):
                acc_a, acc_b = _pair_wgmmas(x_bufs, w_bufs, bars, x_desc, w_desc, layout, first + 2 * j * leaf_tiles,
                                            leaf_tiles, plan, BLOCK_M, BLOCK_N, STAGES, GROUP_M,
                                            PERSISTENT)  # fmt: skip
                acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
                _tree_step(acc_a + acc_b, s0, j, park, out, omask, stride_pl, LEAVES // 2, LOG2_LEAVES - 1, 0)
        else:
            for i in range(LEAVES):
                acc = _leaf_wgmmas(x_bufs, w_bufs, bars, x_desc, w_desc, layout, first + i * leaf_tiles, leaf_tiles,
                                   plan, BLOCK_M, BLOCK_N, STAGES, GROUP_M, PERSISTENT)  # fmt: skip
                acc = warpgroup_mma_wait(0, deps=(acc,))
                s0 = _tree_step(acc, s0, i, park, out, omask, stride_pl, LEAVES, LOG2_LEAVES, PARK_FROM)

    @gluon.jit
    def _leaf_tree_gluon_kernel(
        x_desc, w_desc, out_ptr, park_ptr,
        M, N, stride_op, stride_om, stride_pl, stride_ps,
        LEAF_K, LEAVES: gl.constexpr, LOG2_LEAVES: gl.constexpr, PARK_FROM: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, INSTR_N: gl.constexpr, WARPS_M: gl.constexpr, PAIRS: gl.constexpr,
        PERSISTENT: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        sub = gl.program_id(1)  # the aligned subtree of LEAVES leaves this program evaluates
        leaf_tiles = LEAF_K // BLOCK_K
        total = LEAVES * leaf_tiles
        first_tile = sub * total
        tile0 = gl.program_id(0)
        tile_step = 0
        my_tiles = 1
        if PERSISTENT:  # output tiles tile0, tile0 + programs, ... of the grid's, one after another
            tile_step = gl.num_programs(0)
            my_tiles = (gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N) - tile0 + tile_step - 1) // tile_step

        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M], instr_shape=[16, INSTR_N, 16]
        )
        out, park, omask, plan = _tile_setup(0, tile0, tile_step, my_tiles, sub, first_tile, total, leaf_tiles,
                                             out_ptr, park_ptr, M, N, stride_op, stride_om, stride_ps, layout,
                                             BLOCK_M, BLOCK_N, GROUP_M)  # fmt: skip

        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for t in gl.static_range(STAGES - 1):
            _load_tile(x_desc, w_desc, bars, x_bufs, w_bufs, t, plan, STAGES, PAIRS, GROUP_M, PERSISTENT)

        _output_tile(x_bufs, w_bufs, bars, x_desc, w_desc, 0, plan, out, park, omask, stride_pl, layout, LEAVES,
                     LOG2_LEAVES, PARK_FROM, GROUP_M, STAGES, PAIRS, PERSISTENT)  # fmt: skip
        if PERSISTENT:  # the later tiles' first loads were issued under the tile before's last wgmmas
            for it in range(1, my_tiles):
                out, park, omask, plan = _tile_setup(it, tile0, tile_step, my_tiles, sub, first_tile, total,
                                                     leaf_tiles, out_ptr, park_ptr, M, N, stride_op, stride_om,
                                                     stride_ps, layout, BLOCK_M, BLOCK_N, GROUP_M)  # fmt: skip
                _output_tile(x_bufs, w_bufs, bars, x_desc, w_desc, it * total, plan, out, park, omask, stride_pl,
                             layout, LEAVES, LOG2_LEAVES, PARK_FROM, GROUP_M, STAGES, PAIRS, PERSISTENT)  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def _wgmma_shape(block_m: int, block_n: int, num_warps: int) -> tuple[int, int]:
    """(warps along M, wgmma instruction N) for a [block_m, block_n] accumulator: 4-warp groups of 16-row
    instructions stacked along M first, then the widest instruction N (a multiple of 8, at most 256) that
    divides the columns each group holds. A schedule choice: an element's sum over K is the same either way."""
    warps_m = 4
    while warps_m < num_warps and block_m > 16 * warps_m:
        warps_m *= 2
    cols = block_n // (num_warps // warps_m)
    n = min(256, cols) // 8 * 8
    while cols % n:
        n -= 8
    return warps_m, n


def launch_gluon(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    park: torch.Tensor,
    grid: tuple[int, int],
    strides: tuple[int, int, int, int],
    tree: dict[str, object],
) -> object:
    """Launch :func:`_leaf_tree_gluon_kernel` on ``grid`` (tile, subtree) with the output / park ``strides`` and the
    launch options ``tree`` that ``gemm_triton.leaf_tree_linear_triton`` gives every loop, for operands it has
    checked with :func:`gluon_supported`. ``tree["PAIRS"]`` (the ``gluon_pairs`` loop at two or more leaves): leaves
    two at a time, K tiles alternating; the tree then parks every level from 1 (the caller's scratch has
    ``LOG2_LEAVES - 1`` slots). ``tree["PERSISTENT"]``: one program walks several output tiles."""
    bm, bn, bk = tree["BLOCK_M"], tree["BLOCK_N"], tree["BLOCK_K"]
    dtype = getattr(gl, _GL_DTYPES[x.dtype])
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dtype))
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dtype))
    warps_m, instr_n = _wgmma_shape(bm, bn, tree["num_warps"])
    names = ("LEAF_K", "LEAVES", "LOG2_LEAVES", "PARK_FROM", "GROUP_M", "STAGES", "num_warps")
    return _leaf_tree_gluon_kernel[grid](
        x_desc, w_desc, target, park, x.shape[0], weight.shape[0], *strides, **{k: tree[k] for k in names},
        INSTR_N=instr_n, WARPS_M=warps_m, PAIRS=tree.get("PAIRS", False), PERSISTENT=tree.get("PERSISTENT", False),
    )  # fmt: skip


__all__ = ["gluon_supported", "launch_gluon"]
