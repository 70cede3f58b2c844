"""The leaf-tree GEMM in Gluon (sm_90): one load pipeline across every leaf of a program, wgmma per leaf
(``GemmTileConfig(loop="gluon")`` of :mod:`megatron_iso.ops.gemm.gemm_triton`, the same arithmetic as its other loops).

Why it exists: Triton pipelines one loop at a time. The TMA loop (:mod:`megatron_iso.ops.gemm.gemm_tma_triton`) gives
each leaf its own K loop, so at every leaf end its load pipeline drains and the next leaf's first tiles load while
the tensor cores wait; the flat loop keeps the loads flowing but reads the accumulator inside its loop, so every
wgmma is waited for at once. Gluon states the pipeline explicitly: the TMA loads of the subtree's K tiles run
``STAGES - 1`` tiles ahead through a ring of shared-memory stages and mbarriers, across leaf boundaries; the
wgmmas are issued asynchronously with one kept in flight (a wgmma is waited for once the next one is queued behind
it, and only then is its stage refilled), and the accumulator is read only after a leaf's last wgmma, for the tree
step.

The same bits as the other loops: each leaf is ``acc = 0; acc = mma(x_k, w_k^T, acc)`` over the leaf's K tiles in
increasing order with BLOCK_K = 64 (a fresh zero accumulator, never the instruction's zero-input form, which would
differ in the sign of a zero), and the leaves' fp32 results meet in the same balanced tree
(:func:`~megatron_iso.ops.gemm.leaf_steps_triton._tree_step`). Rows and columns past M and N load as zeros (TMA's
out-of-bounds fill) and are never stored. bf16 / fp16 only (fp32's exact dot is not a wgmma); TMA needs 16-byte
aligned rows (``gemm_tma_triton.tma_supported``). Gluon has no interpreter: the GPU tests hold it to the pointer
loops' bits (tests/gpu/test_gemm_tiles.py).
"""

from __future__ import annotations

import torch
import triton

from megatron_iso.ops.common.interpret import INTERPRET
from megatron_iso.ops.gemm.gemm_tma_triton import tma_supported
from megatron_iso.ops.gemm.leaf_steps_triton import _tile_coords, _tree_step

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
    def _load_tile(x_desc, w_desc, bars, x_bufs, w_bufs, tile, total, first_tile, off_m, off_n,
                   STAGES: gl.constexpr):  # fmt: skip
        """Start the TMA loads of the subtree's K tile ``tile`` into its ring stage (none past the last tile)."""
        stage = tile % STAGES
        k = (first_tile + tile) * x_desc.block_type.shape[1]
        ready = tile < total
        bar = bars.index(stage)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=ready)
        tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_bufs.index(stage), pred=ready)
        tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, w_bufs.index(stage), pred=ready)

    @gluon.jit
    def _leaf_wgmmas(x_bufs, w_bufs, bars, x_desc, w_desc, layout: gl.constexpr, first, count, total, first_tile,
                     off_m, off_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """A leaf's wgmmas, K tiles ``first .. first + count - 1`` from a fresh zero accumulator, at most one left
        running: once the one before a tile's is done, that tile's stage is refilled with the tile ``STAGES - 1``
        ahead."""
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for tile in range(first, first + count):
            stage = tile % STAGES
            mbarrier.wait(bars.index(stage), (tile // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            _load_tile(x_desc, w_desc, bars, x_bufs, w_bufs, tile - 1 + STAGES, total, first_tile, off_m, off_n,
                       STAGES)  # fmt: skip
        return acc

    @gluon.jit
    def _leaf_tree_gluon_kernel(
        x_desc, w_desc, out_ptr, park_ptr,
        M, N, stride_op, stride_om, stride_pl, stride_ps,
        LEAF_K, LEAVES: gl.constexpr, LOG2_LEAVES: gl.constexpr, PARK_FROM: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, INSTR_N: gl.constexpr, WARPS_M: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        pid_m, pid_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        sub = gl.program_id(1)  # the aligned subtree of LEAVES leaves this program evaluates
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        leaf_tiles = LEAF_K // BLOCK_K
        total = LEAVES * leaf_tiles
        first_tile = sub * total

        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M], instr_shape=[16, INSTR_N, 16]
        )
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        omask = (rm[:, None] < M) & (rn[None, :] < N)
        o_off = rm.to(gl.int64)[:, None] * stride_om + rn[None, :]
        park = park_ptr + sub * stride_ps + o_off
        out = out_ptr + sub * stride_op + o_off

        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for t in gl.static_range(STAGES - 1):
            _load_tile(x_desc, w_desc, bars, x_bufs, w_bufs, t, total, first_tile, off_m, off_n, STAGES)

        s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for i in range(LEAVES):
            acc = _leaf_wgmmas(x_bufs, w_bufs, bars, x_desc, w_desc, layout, i * leaf_tiles, leaf_tiles, total,
                               first_tile, off_m, off_n, BLOCK_M, BLOCK_N, STAGES)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(acc,))
            s0 = _tree_step(acc, s0, i, park, out, omask, stride_pl, LEAVES, LOG2_LEAVES, PARK_FROM)
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
    checked with :func:`gluon_supported`."""
    bm, bn, bk = tree["BLOCK_M"], tree["BLOCK_N"], tree["BLOCK_K"]
    dtype = getattr(gl, _GL_DTYPES[x.dtype])
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dtype))
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dtype))
    warps_m, instr_n = _wgmma_shape(bm, bn, tree["num_warps"])
    names = ("LEAF_K", "LEAVES", "LOG2_LEAVES", "PARK_FROM", "GROUP_M", "STAGES", "num_warps")
    return _leaf_tree_gluon_kernel[grid](
        x_desc, w_desc, target, park, x.shape[0], weight.shape[0], *strides, **{k: tree[k] for k in names},
        INSTR_N=instr_n, WARPS_M=warps_m,
    )  # fmt: skip


__all__ = ["gluon_supported", "launch_gluon"]
