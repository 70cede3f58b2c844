"""The leaf-tree GEMM with TMA loads and one pipelined K loop per leaf: a tile loop (``GemmTileConfig(loop="tma")``)
of :mod:`megatron_iso.ops.gemm.gemm_triton`, the same arithmetic as its static and flat loops.

Why it exists: in the flat loop (one software-pipelined loop over every K tile of the subtree, the tree step
predicated at leaf ends) the accumulator is read inside the loop, so Triton waits for each wgmma before the next
(``WARPGROUP.DEPBAR.LE gsb0, 0x0`` in the SASS) and the tensor cores idle while the loads land; its per-thread
pointer tiles (2 x 64 registers at 128 x 128 x 64) and the tree step's tiles then spill. Here each leaf runs its
own pipelined K loop whose accumulator nothing else reads (one wgmma kept in flight, ``0x1``), the loads are
TMA descriptor loads (no pointer tiles), and the tree step runs between leaf loops: on sm_90 the 128 x 128,
8-warp tile compiles with no spill inside the K loop (``tools/kernel_resources.py`` reads this off the cubin on
a machine without a GPU). The price is a pipeline drain at each leaf end.

The same bits as the other loops: each leaf is ``acc = 0; acc = mma(a_k, b_k, acc)`` over the leaf's K tiles in
increasing order with the dtype's BLOCK_K, and the leaves' fp32 results meet in the same balanced tree (level 0
in registers when ``park_from >= 1``, higher levels in the fp32 scratch). Rows and columns past M and N load as
zeros (TMA's out-of-bounds fill) where the pointer loops load a neighbour row: either way no valid output
element sees them, and their results are never stored.

TMA needs 16-byte aligned row strides: K * element size a multiple of 16 (:func:`tma_supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.gemm.leaf_steps_triton import _dot, _tile_coords, _tree_step

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older triton: the loop is not selectable (tma_supported says why)
    TensorDescriptor = None


@triton.jit
def _leaf_tree_tma_kernel(
    x_desc, w_desc, out_ptr, park_ptr,
    M, N, stride_op, stride_om, stride_pl, stride_ps,
    LEAF_K, LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, PARK_FROM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    sub = tl.program_id(1)  # the aligned subtree of LEAVES leaves this program evaluates
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    leaf_tiles = LEAF_K // BLOCK_K
    first_tile = sub * LEAVES * leaf_tiles
    s0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in tl.range(0, LEAVES):
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for t in tl.range(0, leaf_tiles, num_stages=STAGES):
            k = (first_tile + i * leaf_tiles + t) * BLOCK_K
            acc = _dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc, CAST_F32, IEEE)
        rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        rn = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        omask = (rm[:, None] < M) & (rn[None, :] < N)
        o_off = rm[:, None] * stride_om + rn[None, :]
        park = park_ptr + sub * stride_ps + o_off
        out = out_ptr + sub * stride_op + o_off
        s0 = _tree_step(acc, s0, i, park, out, omask, stride_pl, LEAVES, LOG2_LEAVES, PARK_FROM)


def tma_supported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None when the TMA loop can run these operands, else why not (for the caller's error)."""
    if TensorDescriptor is None:
        return f"triton {triton.__version__} has no triton.tools.tensor_descriptor"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (9, 0):
        return "TMA loads need sm_90 or newer, device is sm_{}{}".format(*torch.cuda.get_device_capability(x.device))
    for name, t in (("x", x), ("weight", weight)):
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name} needs a contiguous last dim, 16-byte aligned rows and base (stride {t.stride()})"
    return None


def launch_tma(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    park: torch.Tensor,
    grid: tuple[int, int],
    strides: tuple[int, int, int, int],
    tree: dict[str, object],
) -> object:
    """Launch :func:`_leaf_tree_tma_kernel` on ``grid`` (tile, subtree) with the output / park ``strides`` and the
    launch options ``tree`` that ``gemm_triton.leaf_tree_linear_triton`` gives its pointer loops, for operands it
    has checked with :func:`tma_supported`."""
    x_desc = TensorDescriptor.from_tensor(x, [tree["BLOCK_M"], tree["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(weight, [tree["BLOCK_N"], tree["BLOCK_K"]])
    return _leaf_tree_tma_kernel[grid](x_desc, w_desc, target, park, x.shape[0], weight.shape[0], *strides, **tree)


__all__ = ["launch_tma", "tma_supported"]
