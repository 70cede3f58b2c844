"""Grouped leaf-tree GEMM in Triton: all experts' ``x_e @ w_e.T`` in one launch (MoE experts, GPU).

Invariant kept: a row's bits equal the dense kernel's (``gemm_triton.leaf_tree_linear_triton`` on that expert's rows
alone), whatever the other experts receive: the dense kernel's jit tile code and tile, an expert starting a fresh
M-tile, one program per tile's leaf tree. Tiles are found on the device from the counts (grid bound by T and E
only), so the launch is static for CUDA graphs; expert weights are addressed through a cached int64 offset table,
not copied.

Design: docs/KERNELS.md, "Grouped GEMM kernel".
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.interpret import INTERPRET as _INTERPRET
from megatron_iso.ops.gemm.gemm_triton import (
    CONFIGS,
    INTERPRET_CONFIG,
    GemmTileConfig,
    _check,
    _flat_tile,
    _static_tile,
    _tile_coords,
    select_config,
)
from megatron_iso.ops.gemm.grouped import OP, Weights, check_inputs, expert_weights
from megatron_iso.registry import OpImpl, Profile, register

IMPL_ID = "grouped_leaf_tree_gemm.triton"
VERSION = "1"
# Address tables by (device, element size, weight addresses); at most this many kept (2 per MoE layer).
_TABLE_CACHE_SIZE = 1024
_TABLES: OrderedDict[tuple, tuple[torch.Tensor, bool]] = OrderedDict()


@triton.jit
def _expert_of_tile(counts_ptr, pid_m, T, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, its first row, its rows, the tile's index within the expert) of the ``pid_m``-th M-tile, tiles of
    each expert starting fresh at its first row; expert == E for programs past the last tile."""
    idx = tl.arange(0, E_POW2)
    rows = tl.maximum(tl.load(counts_ptr + idx, mask=idx < E, other=0), 0)
    ends = tl.cumsum(rows, 0)
    starts = tl.minimum(ends - rows, T)  # clamped so that bad counts never address outside the tensors
    rows = tl.minimum(ends, T) - starts
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    tiles_done = tl.cumsum(tiles, 0)
    e = tl.sum((tiles_done <= pid_m).to(tl.int32), 0)
    sel = idx == e
    row0 = tl.sum(tl.where(sel, starts, 0), 0).to(tl.int64)
    m_e = tl.sum(tl.where(sel, rows, 0), 0).to(tl.int32)
    local = pid_m - tl.sum(tl.where(sel, tiles_done - tiles, 0), 0).to(tl.int32)
    return e, row0, m_e, local


@triton.jit
def _grouped_leaf_tree_kernel(
    x_ptr, w_ptr, w_off_ptr, counts_ptr, out_ptr, park_ptr,
    T, N, E, M_TILES,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_pl,
    LEAF_K, LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, PARK_FROM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, CAST_F32: tl.constexpr, IEEE: tl.constexpr,
    E_POW2: tl.constexpr, W_ALIGN: tl.constexpr, FLAT: tl.constexpr,
):  # fmt: skip
    # Grouped order over the virtual [M_TILES * BLOCK_M, N] output, as the dense kernel orders its tiles.
    pid_m, pid_n = _tile_coords(M_TILES * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    e, row0, m_e, local_m = _expert_of_tile(counts_ptr, pid_m, T, E, BLOCK_M, E_POW2)
    if e < E:
        w_e = w_ptr + tl.multiple_of(tl.load(w_off_ptr + e), W_ALIGN)
        x_e = x_ptr + row0 * stride_xm
        out_e = out_ptr + row0 * stride_om
        park_e = park_ptr + row0 * stride_om
        if FLAT:
            _flat_tile(
                x_e, w_e, out_e, park_e, m_e, N, local_m, pid_n, 0,
                stride_xm, stride_xk, stride_wn, stride_wk, 0, stride_om, stride_pl, 0,
                LEAF_K, LEAVES, LOG2_LEAVES, PARK_FROM, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CAST_F32, IEEE,
            )  # fmt: skip
        else:
            _static_tile(
                x_e, w_e, out_e, park_e, m_e, N, local_m, pid_n, 0,
                stride_xm, stride_xk, stride_wn, stride_wk, 0, stride_om, stride_pl, 0,
                LEAF_K, LEAVES, LOG2_LEAVES, PARK_FROM, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CAST_F32, IEEE,
            )  # fmt: skip


def weight_table(ws: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """``(int64 offsets of each weight from ws[0] in elements, on the weights' device; all 16-byte aligned?)``.

    Cached by the addresses; a weight at an address not a whole number of elements from ws[0] is an error.
    """
    esize = ws[0].element_size()
    ptrs = tuple(w.data_ptr() for w in ws)
    key = (str(ws[0].device), esize, ptrs)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    base = ptrs[0]
    bad = [i for i, p in enumerate(ptrs) if (p - base) % esize]
    if bad:
        raise ValueError(f"grouped_gemm: weights{bad} are not a whole number of elements away from weights[0]")
    offsets = torch.tensor([(p - base) // esize for p in ptrs], dtype=torch.int64)
    if ws[0].device.type == "cuda":
        # Pinned, so the copy does not synchronise the stream (pageable host-to-device copies do).
        offsets = offsets.pin_memory().to(ws[0].device, non_blocking=True)
    entry = (offsets, all(p % 16 == 0 for p in ptrs))
    _TABLES[key] = entry
    if len(_TABLES) > _TABLE_CACHE_SIZE:
        _TABLES.popitem(last=False)
    return entry


def m_tiles_bound(t: int, e: int, block_m: int) -> int:
    """Upper bound on sum_e cdiv(count_e, block_m) over all count vectors summing to t (each tile has a row,
    and each expert adds at most one partial tile)."""
    return min(t, (t + e * (block_m - 1)) // block_m)


def grouped_config(dtype: torch.dtype, t: int, e: int, leaves: int) -> GemmTileConfig:
    """The dense ``select_config`` tile for the average rows per expert: a schedule choice only (every
    candidate shares BLOCK_K and the K-loop order with the dense kernel)."""
    return select_config(dtype, max(1, t // e), leaves)


def grouped_leaf_tree_linear_triton(
    x: torch.Tensor,
    weights: Weights,
    counts: torch.Tensor,
    leaves: int,
    *,
    config: GemmTileConfig | None = None,
    check_counts: bool = True,
) -> torch.Tensor:
    """fp32 ``[T, N]``: ``x[rows of e] @ weights[e].T`` for each expert e, rows sorted by expert.

    ``counts`` (rows per expert, integer, on any device) is read by the kernel on the device; with
    ``check_counts`` a CUDA-resident ``counts`` is checked (``>= 0``, sum == T) by an asynchronous device
    assert, no host sync. ``config`` is for tests and benchmarks (any tile with the dtype's BLOCK_K and
    loop gives the same bits).
    """
    ws = expert_weights(weights)
    t, n, k = check_inputs(x, ws, counts, leaves)
    _check(x, ws[0], leaves)  # the dense kernel's dtype / shape rules
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"grouped_leaf_tree_linear_triton: x is on {x.device}; the Triton kernel needs cuda")
    e = len(ws)
    stride_n, stride_k = ws[0].stride()
    if any(w.stride() != (stride_n, stride_k) for w in ws):
        raise ValueError("grouped_leaf_tree_linear_triton: every expert weight must have the same strides")
    cfg = config or (INTERPRET_CONFIG if _INTERPRET else grouped_config(x.dtype, t, e, leaves))
    if cfg.block_k != (INTERPRET_CONFIG if _INTERPRET else CONFIGS[x.dtype]).block_k:
        raise ValueError(
            f"grouped_leaf_tree_linear_triton: config.block_k={cfg.block_k} differs from the dense kernel's "
            f"{CONFIGS[x.dtype].block_k} for {x.dtype}: the result would not be the dense leaf tree's"
        )
    if cfg.loop not in ("static", "flat"):
        raise ValueError(f"grouped_leaf_tree_linear_triton: config.loop={cfg.loop!r} must be 'static' or 'flat'")
    leaf_k = k // leaves
    if leaf_k % cfg.block_k:
        raise ValueError(
            f"grouped_leaf_tree_linear_triton: leaf depth K/leaves={leaf_k} is not a multiple of block_k={cfg.block_k}"
        )
    log2 = leaves.bit_length() - 1
    if log2 > 4:
        raise ValueError(f"grouped_leaf_tree_linear_triton: at most 16 leaves, got leaves={leaves}")
    out = torch.empty((t, n), device=x.device, dtype=torch.float32)
    if t == 0 or n == 0:
        return out
    counts = counts.to(x.device, non_blocking=True)
    if check_counts and counts.device.type == "cuda":
        torch._assert_async(((counts >= 0).all() & (counts.sum() == t)), "grouped_gemm: counts must be >= 0, sum T")
    table, aligned = weight_table(ws)
    flat = cfg.loop == "flat" and leaves > 1
    park_from = min(cfg.park_from, 1) if flat else cfg.park_from
    n_park = max(0, log2 - park_from)
    park = torch.empty((n_park, t, n), device=x.device, dtype=torch.float32) if n_park else out
    m_tiles = m_tiles_bound(t, e, cfg.block_m)
    grid = (m_tiles * triton.cdiv(n, cfg.block_n),)
    _grouped_leaf_tree_kernel[grid](
        x, ws[0], table, counts, out, park,
        t, n, e, m_tiles,
        x.stride(0), x.stride(1), stride_n, stride_k, n, t * n,
        LEAF_K=leaf_k, LEAVES=leaves, LOG2_LEAVES=log2, PARK_FROM=park_from,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, CAST_F32=_INTERPRET and x.dtype != torch.float32,
        IEEE=x.dtype == torch.float32 and cfg.fp32_precision == "ieee",
        E_POW2=triton.next_power_of_2(e), W_ALIGN=16 // ws[0].element_size() if aligned else 1, FLAT=flat,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def _probe() -> dict[str, torch.Tensor]:
    """Golden probe on fixed seeded inputs (CUDA only): digests go to the lockfile."""
    g = torch.Generator(device="cpu").manual_seed(4321)
    x = torch.randn(11, 512, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(4, 384, 512, generator=g).to(torch.bfloat16).cuda()
    counts = torch.tensor([3, 0, 1, 7], device="cuda")
    return {"bf16_t11_e4_n384_k512_g8": grouped_leaf_tree_linear_triton(x, w, counts, 8).cpu()}


register(
    OpImpl(
        op=OP,
        impl_id=IMPL_ID,
        version=VERSION,
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=grouped_leaf_tree_linear_triton,
        constants={
            "per_expert": "leaf_tree_gemm.triton tile code on each expert's rows (bitwise the dense result)",
            "accumulate": "fp32",
            "row_order": "sorted by expert, counts per expert",
            "schedule": "one program per (expert, M-tile, N-tile), whole leaf tree per program",
            "bf16_block_k": CONFIGS[torch.bfloat16].block_k,
            "fp32_block_k": CONFIGS[torch.float32].block_k,
            "triton": triton.__version__,
        },
        probe=_probe,
    )
)

__all__ = ["grouped_config", "grouped_leaf_tree_linear_triton", "m_tiles_bound", "weight_table"]
