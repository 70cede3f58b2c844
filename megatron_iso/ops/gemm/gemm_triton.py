"""Leaf-tree GEMM in Triton: the GPU path of the invariant linear layer.

``out = x @ weight.T`` with K cut into ``leaves`` contiguous equal leaves; each leaf an fp32-accumulating GEMM over
its K-tiles in increasing order (one BLOCK_K per dtype, no split-K inside a leaf), the leaves added by the fixed tree
of :mod:`megatron_iso.ops.common.tree`. Invariant kept: a row's bits never depend on M or the other rows. Tile shape
(:func:`select_config`), the subtree-parallel schedule (``parallel``) and parking tree levels in scratch
(``park_from``) are schedules that move no bit; TP shards are nodes of the same tree.

Design: docs/KERNELS.md, "Leaf-tree GEMM".
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.interpret import INTERPRET as _INTERPRET
from megatron_iso.ops.common.sm_count import sm_count
from megatron_iso.ops.gemm.gemm_gluon_triton import gluon_supported, launch_gluon
from megatron_iso.ops.gemm.gemm_tma_triton import launch_tma, tma_supported
from megatron_iso.ops.gemm.leaf_steps_triton import _dot, _tile_coords, _tree_step
from megatron_iso.ops.gemm.tiles import TRITON_BLOCK_K, GemmTileConfig
from megatron_iso.registry import OpImpl, Profile, register

IMPL_ID = "leaf_tree_gemm.triton"
VERSION = "4"  # 4: TMA / Gluon loops at large M; 3: a 16-row tile bucket; tiles bitwise-equivalent since 2
# The loops over TMA descriptors: what refuses operands a loop cannot run (why, or None), and its launcher.
_DESCRIPTOR_LOOPS = {"tma": (tma_supported, launch_tma), "gluon": (gluon_supported, launch_gluon)}


# The correctness profile's configs. All share BLOCK_K and the K-loop order per dtype; the bitwise
# equivalence of tiles with the same BLOCK_K (tests/gpu/test_gemm_tiles.py, tools/bench_ops.py
# ``gemm_tile_equivalence``) is what allows choosing the tile from (M bucket, leaves per program):
# a row's bits are the same whichever of these tiles computes it.
_BK16 = TRITON_BLOCK_K["bf16"]
assert TRITON_BLOCK_K["fp16"] == _BK16  # bf16 and fp16 share their tiles
CONFIGS: dict[torch.dtype, GemmTileConfig] = {
    torch.bfloat16: GemmTileConfig(block_m=128, block_n=128, block_k=_BK16, num_warps=8, num_stages=4),
    torch.float16: GemmTileConfig(block_m=128, block_n=128, block_k=_BK16, num_warps=8, num_stages=4),
    torch.float32: GemmTileConfig(
        block_m=64, block_n=64, block_k=TRITON_BLOCK_K["fp32"], num_warps=4, num_stages=3, loop="static"
    ),
}
# Buckets picked from candidate sweeps on an H200 (``bench_ops.py``, ``gemm_candidates``; docs/perf/NOTES_gemm.md), for
# bf16 and fp16 alike (the tables are named after the dtype they were timed on); every tile here is held to the
# default's bits by tests/gpu/test_gemm_tiles.py (``selectable_tiles``).
_BF16_TILES = {
    # (M bucket, one leaf in the kernel?) -> tile
    # M <= 16 (batch-1..16 decode): 16-row tiles (mma, not wgmma) waste no MMA rows and put 4x the programs of a
    # 64-row tile on the weight stream; deep pipelines keep its bytes in flight.
    ("tiny", True): GemmTileConfig(block_m=16, block_n=64, block_k=_BK16, num_warps=4, num_stages=8),
    ("tiny", False): GemmTileConfig(block_m=16, block_n=64, block_k=_BK16, num_warps=4, num_stages=4),
    ("small", True): GemmTileConfig(block_m=64, block_n=64, block_k=_BK16, num_warps=4, num_stages=8),
    ("small", False): GemmTileConfig(block_m=64, block_n=128, block_k=_BK16, num_warps=4, num_stages=4),
    ("mid", True): GemmTileConfig(block_m=64, block_n=128, block_k=_BK16, num_warps=4, num_stages=4),
    ("large", True): GemmTileConfig(block_m=128, block_n=256, block_k=_BK16, num_warps=8, num_stages=3),
}
# Large M where the operands allow TMA descriptors (sm_90, 16-byte aligned rows): the descriptor loops, chosen from
# ``bench_ops.py --sweep`` at the Qwen3-8B row-parallel shapes (docs/perf/NOTES_gemm.md). At 8 leaves the Gluon loop (one
# load pipeline across the leaves, level 0 in registers) runs 1.5-1.7x the flat loop; at one leaf the TMA loop's
# 128x256 tile gains 2-5% over the flat one. Elsewhere, and in the grouped expert GEMM, the pointer loops above.
_BF16_DESCRIPTOR_TILES = {
    ("large", True): GemmTileConfig(block_m=128, block_n=256, block_k=_BK16, num_warps=8, num_stages=4, loop="tma"),
    ("large", False): GemmTileConfig(
        block_m=128, block_n=128, block_k=_BK16, num_warps=8, num_stages=4, park_from=1, loop="gluon"
    ),
}
# One leaf at M <= 16 and N >= WIDE_N (an LM head): thousands of programs already, so wider tiles stream better.
WIDE_N = 32768
_BF16_TINY_WIDE_N = GemmTileConfig(block_m=16, block_n=128, block_k=_BK16, num_warps=4, num_stages=4)
TINY_M = 16  # M <= 16: one to a few decode rows
SMALL_M = 64  # M <= 64: decode, weight streaming
MID_M = 256  # 64 < M <= 256: too few 128-row tiles to fill 132 SMs


def select_config(
    dtype: torch.dtype, M: int, leaves: int, N: int = 0, *, descriptor_loops: bool = False
) -> GemmTileConfig:
    """The tile for a launch, by (dtype, M bucket, leaves == 1, and N for one-leaf tiny M); with
    ``descriptor_loops`` (the caller's operands can take TMA descriptors) the TMA / Gluon tile where one is chosen.
    Never changes a bit: every candidate shares BLOCK_K and the K-loop order, and tiles with the same BLOCK_K are
    bitwise equivalent (tests/gpu/test_gemm_tiles.py). fp32 keeps its one config."""
    if dtype not in (torch.bfloat16, torch.float16):
        return CONFIGS[dtype]
    bucket = "tiny" if M <= TINY_M else "small" if M <= SMALL_M else "mid" if M <= MID_M else "large"
    if bucket == "tiny" and leaves == 1 and N >= WIDE_N:
        return _BF16_TINY_WIDE_N
    key = (bucket, leaves == 1)
    if descriptor_loops and key in _BF16_DESCRIPTOR_TILES:
        return _BF16_DESCRIPTOR_TILES[key]
    return _BF16_TILES.get(key, CONFIGS[dtype])


def selectable_tiles(dtype: torch.dtype, *, descriptor_loops: bool = True) -> list[GemmTileConfig]:
    """Every tile :func:`select_config` can pick for ``dtype``, the default first: what the tile-equivalence
    tests hold to the default's bits (``descriptor_loops=False``: the pointer loops only, as the grouped GEMM)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return [CONFIGS[dtype]]
    tiles = [CONFIGS[dtype]]
    extra = _BF16_DESCRIPTOR_TILES.values() if descriptor_loops else ()
    for cfg in (*_BF16_TILES.values(), _BF16_TINY_WIDE_N, *extra):
        if cfg not in tiles:
            tiles.append(cfg)
    return tiles


def _selected_config(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> GemmTileConfig:
    """:func:`select_config` for these operands: a descriptor loop's tile where that loop can run them."""
    M, N = x.shape[0], weight.shape[0]
    cfg = select_config(x.dtype, M, leaves, N, descriptor_loops=True)
    if cfg.loop in _DESCRIPTOR_LOOPS and _DESCRIPTOR_LOOPS[cfg.loop][0](x, weight) is not None:
        cfg = select_config(x.dtype, M, leaves, N)
    return cfg


# Under TRITON_INTERPRET=1 (CPU tests) tiles are small so tiny shapes still cover several tiles and leaves.
INTERPRET_CONFIG = GemmTileConfig(block_m=16, block_n=16, block_k=8, num_warps=4, num_stages=1, park_from=1)


def _check(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"leaf_tree_linear_triton: x must be [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.dtype not in CONFIGS:
        raise TypeError(f"leaf_tree_linear_triton: unsupported dtype {x.dtype}; supported {sorted(map(str, CONFIGS))}")
    if weight.dtype != x.dtype:
        raise TypeError(f"leaf_tree_linear_triton: weight dtype {weight.dtype} != x dtype {x.dtype}")
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"leaf_tree_linear_triton: leaves={leaves} must be a power of two >= 1")
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K:
        raise ValueError(f"leaf_tree_linear_triton: K mismatch, x has {K}, weight has {K2}")
    if K % leaves:
        raise ValueError(f"leaf_tree_linear_triton: K={K} is not divisible by leaves={leaves}")
    return M, N, K


@triton.jit
def _static_tile(
    x_ptr, w_ptr, out_ptr, park_ptr,
    M, N, pid_m, pid_n, sub,
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_op, stride_om, stride_pl, stride_ps,
    LEAF_K, LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, PARK_FROM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # One output tile (pid_m, pid_n) of x[M, K] @ w[N, K].T, subtree ``sub`` of the leaf tree. A helper
    # (inlined by Triton) so the dense and the grouped (MoE) kernels run the very same leaf code.
    # Indices are int64: an LM head's logits (14k tokens x 152k vocab) pass 2^31 elements, and int32
    # offsets wrapped into an illegal address. Addresses only: the arithmetic is unchanged.
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows/cols load a valid neighbour (modulo) instead of masking: cheaper loads, and a
    # row's arithmetic never sees another row anyway. Stores are masked.
    am = rm % M
    bn = rn % N
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    k_base = sub * (LEAVES * LEAF_K)
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    o_off = rm[:, None] * stride_om + rn[None, :]
    park = park_ptr + sub * stride_ps + o_off
    s0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0
    for i in tl.static_range(LEAVES):
        k0 = k_base + i * LEAF_K
        a_ptrs = x_ptr + am[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk
        b_ptrs = w_ptr + bn[None, :] * stride_wn + (k0 + rk)[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for _ in tl.range(0, LEAF_K, BLOCK_K, num_stages=STAGES):
            acc = _dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, CAST_F32, IEEE)
            a_ptrs += BLOCK_K * stride_xk
            b_ptrs += BLOCK_K * stride_wk
        # Stack evaluation of the balanced tree: leaf i closes one subtree per trailing one bit of i.
        v = acc
        for lvl in tl.static_range(LOG2_LEAVES):
            if (i + 1) % (2 << lvl) == 0:
                if lvl >= PARK_FROM:
                    left = tl.load(park + (lvl - PARK_FROM) * stride_pl, mask=omask)
                elif lvl == 0:
                    left = s0
                elif lvl == 1:
                    left = s1
                elif lvl == 2:
                    left = s2
                else:
                    left = s3
                v = left + v
        if i == LEAVES - 1:
            tl.store(out_ptr + sub * stride_op + o_off, v, mask=omask)
        else:
            for lvl in tl.static_range(LOG2_LEAVES):
                # park v at level lvl = number of trailing ones of i
                if ((i + 1) % (1 << lvl) == 0) and ((i + 1) % (2 << lvl) != 0):
                    if lvl >= PARK_FROM:
                        tl.store(park + (lvl - PARK_FROM) * stride_pl, v, mask=omask)
                    elif lvl == 0:
                        s0 = v
                    elif lvl == 1:
                        s1 = v
                    elif lvl == 2:
                        s2 = v
                    else:
                        s3 = v


@triton.jit
def _flat_tile(
    x_ptr, w_ptr, out_ptr, park_ptr,
    M, N, pid_m, pid_n, sub,
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_op, stride_om, stride_pl, stride_ps,
    LEAF_K, LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, PARK_FROM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Same arithmetic as the static tile; one software-pipelined loop runs through all K-tiles of the
    # subtree so loads for the next leaf are already in flight while a leaf closes. Level 0 may stay in
    # registers (PARK_FROM >= 1); higher levels are parked in global scratch.
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: see _static_tile
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    am = rm % M
    bn = rn % N
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    k_base = sub * (LEAVES * LEAF_K)
    a_ptrs = x_ptr + am[:, None] * stride_xm + (k_base + rk)[None, :] * stride_xk
    b_ptrs = w_ptr + bn[None, :] * stride_wn + (k_base + rk)[:, None] * stride_wk
    LEAF_TILES = LEAF_K // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    s0 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for t in tl.range(0, LEAVES * LEAF_TILES, num_stages=STAGES):
        acc = _dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, CAST_F32, IEEE)
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk
        if (t + 1) % LEAF_TILES == 0:
            i = t // LEAF_TILES  # the leaf that just closed
            # Tile-shaped pointers and masks are built here, not before the loop: held across the loop they
            # cost 2 registers per element each and made the 8-leaf kernel spill.
            rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            omask = (rm[:, None] < M) & (rn[None, :] < N)
            o_off = rm[:, None] * stride_om + rn[None, :]
            park = park_ptr + sub * stride_ps + o_off
            out = out_ptr + sub * stride_op + o_off
            s0 = _tree_step(acc, s0, i, park, out, omask, stride_pl, LEAVES, LOG2_LEAVES, PARK_FROM)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)


@triton.jit
def _leaf_tree_static_kernel(
    x_ptr, w_ptr, out_ptr, park_ptr,
    M, N,
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_op, stride_om, stride_pl, stride_ps,
    LEAF_K, LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, PARK_FROM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    sub = tl.program_id(1)  # which aligned subtree of LEAVES leaves this program evaluates
    _static_tile(
        x_ptr, w_ptr, out_ptr, park_ptr, M, N, pid_m, pid_n, sub,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_op, stride_om, stride_pl, stride_ps,
        LEAF_K, LEAVES, LOG2_LEAVES, PARK_FROM, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CAST_F32, IEEE,
    )  # fmt: skip


@triton.jit
def _leaf_tree_flat_kernel(
    x_ptr, w_ptr, out_ptr, park_ptr,
    M, N,
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_op, stride_om, stride_pl, stride_ps,
    LEAF_K, LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, PARK_FROM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    sub = tl.program_id(1)
    _flat_tile(
        x_ptr, w_ptr, out_ptr, park_ptr, M, N, pid_m, pid_n, sub,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_op, stride_om, stride_pl, stride_ps,
        LEAF_K, LEAVES, LOG2_LEAVES, PARK_FROM, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CAST_F32, IEEE,
    )  # fmt: skip


@triton.jit
def _tree_combine_kernel(p_ptr, out_ptr, numel, stride_p, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    # Finishes the tree over PARTS aligned subtree nodes: adjacent pairs, level by level (balanced).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # numel may pass 2^31
    mask = offs < numel
    if PARTS == 2:
        v = tl.load(p_ptr + offs, mask=mask) + tl.load(p_ptr + stride_p + offs, mask=mask)
    elif PARTS == 4:
        v01 = tl.load(p_ptr + offs, mask=mask) + tl.load(p_ptr + stride_p + offs, mask=mask)
        v23 = tl.load(p_ptr + 2 * stride_p + offs, mask=mask) + tl.load(p_ptr + 3 * stride_p + offs, mask=mask)
        v = v01 + v23
    else:
        v01 = tl.load(p_ptr + offs, mask=mask) + tl.load(p_ptr + stride_p + offs, mask=mask)
        v23 = tl.load(p_ptr + 2 * stride_p + offs, mask=mask) + tl.load(p_ptr + 3 * stride_p + offs, mask=mask)
        v45 = tl.load(p_ptr + 4 * stride_p + offs, mask=mask) + tl.load(p_ptr + 5 * stride_p + offs, mask=mask)
        v67 = tl.load(p_ptr + 6 * stride_p + offs, mask=mask) + tl.load(p_ptr + 7 * stride_p + offs, mask=mask)
        v = (v01 + v23) + (v45 + v67)
    tl.store(out_ptr + offs, v, mask=mask)


# The last compiled leaf kernel (registers / spills are read off it by tools/bench_ops.py).
LAST_COMPILED = None


def auto_parallel(M: int, N: int, leaves: int, cfg: GemmTileConfig, sm_count: int) -> int:
    """How many programs share one output tile's leaf tree: a schedule choice, never an arithmetic one.

    Enough programs to put about two waves on the machine when the tile count alone is too small
    (decode-sized M), capped at the number of leaves and at 8 (the combine kernel's limit).
    """
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    p = 1
    while p < leaves and p < 8 and tiles * p < sm_count:
        p *= 2
    return p


def leaf_tree_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    leaves: int,
    *,
    parallel: int | None = None,
    config: GemmTileConfig | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x[M, K] @ weight[N, K].T`` as a ``leaves``-leaf tree of fp32 GEMMs; returns ``[M, N]`` in ``out_dtype``.

    The tree's root is fp32; with a 16-bit ``out_dtype`` the kernel rounds it once (to nearest even, as
    ``Tensor.to`` does) as it stores it, so the fp32 tile never goes to memory. ``parallel`` (programs per
    output tile) and ``config`` are for tests and benchmarks; the correctness profile uses
    :func:`select_config` and :func:`auto_parallel`.
    """
    M, N, K = _check(x, weight, leaves)
    cfg = config or (INTERPRET_CONFIG if _INTERPRET else _selected_config(x, weight, leaves))
    leaf_k = K // leaves
    if leaf_k % cfg.block_k:
        raise ValueError(
            f"leaf_tree_linear_triton: leaf depth K/leaves={leaf_k} is not a multiple of block_k={cfg.block_k}"
        )
    out = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if parallel is None:
        parallel = auto_parallel(M, N, leaves, cfg, sm_count(x.device))
    if parallel < 1 or parallel & (parallel - 1) or parallel > min(leaves, 8):
        raise ValueError(f"leaf_tree_linear_triton: parallel={parallel} must be a power of two <= min(leaves, 8)")
    per_prog = leaves // parallel
    log2 = per_prog.bit_length() - 1
    if log2 > 4:
        raise ValueError(f"leaf_tree_linear_triton: at most 16 leaves per program, got {per_prog}")
    # The static loop keeps levels below park_from in registers; the flat, TMA and Gluon loops at most level 0.
    park_from = cfg.park_from if cfg.loop == "static" else min(cfg.park_from, 1)
    if cfg.loop == "gluon" and log2 <= 1:
        park_from = 0  # Triton 3.6 fails to lower the Gluon kernel's register level 0 in a 1- or 2-leaf tree
    n_park = max(0, log2 - park_from)
    target = out if parallel == 1 else torch.empty((parallel, M, N), device=x.device, dtype=torch.float32)
    # One scratch slot per parked level per subtree program; N-contiguous like the output.
    park = torch.empty((max(1, parallel * n_park), M, N), device=x.device, dtype=torch.float32) if n_park else target
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), parallel)
    # Output / park strides (subtree, row, park level, park subtree), then the launch options every loop takes.
    strides = (M * N if parallel > 1 else 0, N, M * N, n_park * M * N)
    tree = dict(
        LEAF_K=leaf_k, LEAVES=per_prog, LOG2_LEAVES=log2, PARK_FROM=park_from,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, CAST_F32=_INTERPRET and x.dtype != torch.float32,
        IEEE=x.dtype == torch.float32 and cfg.fp32_precision == "ieee",
        num_warps=cfg.num_warps,
    )  # fmt: skip
    global LAST_COMPILED
    if cfg.loop in _DESCRIPTOR_LOOPS:
        supported, launch = _DESCRIPTOR_LOOPS[cfg.loop]
        why = supported(x, weight) if config is not None else None  # a selected tile was checked by the selection
        if why is not None:
            raise ValueError(f"leaf_tree_linear_triton: loop={cfg.loop!r} cannot run: {why}")
        LAST_COMPILED = launch(x, weight, target, park, grid, strides, tree)
    else:
        kernel = _leaf_tree_static_kernel if (cfg.loop == "static" or per_prog == 1) else _leaf_tree_flat_kernel
        LAST_COMPILED = kernel[grid](
            x,
            weight,
            target,
            park,
            M,
            N,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            *strides,
            **tree,
        )
    if parallel > 1:
        numel = M * N
        block = 1024
        _tree_combine_kernel[(triton.cdiv(numel, block),)](target, out, numel, M * N, PARTS=parallel, BLOCK=block)
    return out


leaf_tree_linear_triton.rounds_output = True  # type: ignore[attr-defined]  # see ops.gemm.linear


def _tile_record(c: GemmTileConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} {c.loop} p{c.park_from}"


def _probe() -> dict[str, torch.Tensor]:
    """Golden probe on fixed seeded inputs (CUDA only): digests go to the lockfile."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(7, 512, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(384, 512, generator=g).to(torch.bfloat16).cuda()
    return {"bf16_m7_n384_k512_g8": leaf_tree_linear_triton(x, w, 8).cpu()}


register(
    OpImpl(
        op="gemm",
        impl_id=IMPL_ID,
        version=VERSION,
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=leaf_tree_linear_triton,
        constants={
            "accumulate": "fp32",
            "leaves_policy": "K cut into `leaves` equal contiguous leaves; balanced fp32 tree, left = lower",
            "bf16_tile": [
                CONFIGS[torch.bfloat16].block_m,
                CONFIGS[torch.bfloat16].block_n,
                CONFIGS[torch.bfloat16].block_k,
            ],
            "bf16_num_warps": CONFIGS[torch.bfloat16].num_warps,
            "bf16_num_stages": CONFIGS[torch.bfloat16].num_stages,
            "fp32_tile": [
                CONFIGS[torch.float32].block_m,
                CONFIGS[torch.float32].block_n,
                CONFIGS[torch.float32].block_k,
            ],
            "fp32_precision": CONFIGS[torch.float32].fp32_precision,
            "bf16_tiles_by_bucket": [
                f"{b}/{'leaves1' if one else 'leaves>1'}: {_tile_record(c)}"
                for (b, one), c in sorted(_BF16_TILES.items())
            ],
            "bf16_descriptor_tiles_by_bucket": [
                f"{b}/{'leaves1' if one else 'leaves>1'}: {_tile_record(c)}"
                for (b, one), c in sorted(_BF16_DESCRIPTOR_TILES.items())
            ],
            "bf16_tiny_m_wide_n_tile": [
                asdict(_BF16_TINY_WIDE_N)[f] for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages")
            ],
            "m_buckets": [TINY_M, SMALL_M, MID_M],
            "wide_n": WIDE_N,
            "triton": triton.__version__,
        },
        probe=_probe,
    )
)

__all__ = [
    "CONFIGS",
    "GemmTileConfig",
    "asdict",
    "auto_parallel",
    "leaf_tree_linear_triton",
    "select_config",
    "selectable_tiles",
]
