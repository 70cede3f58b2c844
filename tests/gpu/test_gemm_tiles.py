"""Tile equivalence of the leaf-tree GEMM: the proof that lets the tile depend on M.

Claim: with the same BLOCK_K and K-loop order, every (BLOCK_M, BLOCK_N, warps, stages) computes
each output element by the same arithmetic, so the result bits do not depend on the tile. This is
what allows ``select_config`` to pick a narrow tile for decode-sized M and a 128x256 tile for
one-leaf GEMMs while a row's bits stay independent of M. Bit patterns compared, never tolerances.
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
triton = pytest.importorskip("triton")


def _rand(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(dtype)


def _tiles(dtype):
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C
    from megatron_iso.ops.gemm.gemm_triton import selectable_tiles

    if dtype == torch.float32:
        return [*selectable_tiles(dtype), C(128, 64, 32, 4, 3, loop="static"), C(64, 128, 32, 8, 2, loop="static"),
                C(32, 32, 32, 4, 4, loop="static")]  # fmt: skip
    return [*selectable_tiles(dtype), C(64, 32, 64, 4, 6), C(128, 64, 64, 4, 4), C(16, 32, 64, 2, 8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("leaves", [1, 8])
def test_tiles_with_same_block_k_give_same_bits(dtype, leaves):
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as f

    x, w = _rand((300, 2048), dtype, 41), _rand((640, 2048), dtype, 42)
    tiles = _tiles(dtype)
    base = f(x, w, leaves, parallel=1, config=tiles[0]).view(torch.int32)
    for cfg in tiles[1:]:
        if leaves > 1 and cfg.block_n >= 256:
            cfg = type(cfg)(**{**cfg.__dict__, "num_stages": 2})  # the 8-leaf park buffer needs the smem
        assert torch.equal(f(x, w, leaves, parallel=1, config=cfg).view(torch.int32), base), cfg


# The TMA loop (ops/gemm/gemm_tma_triton.py): candidates for large M, held to the pointer loops' bits.
TMA_TILES = [(128, 128, 8, 4, 0), (128, 128, 8, 3, 1), (128, 64, 8, 4, 1), (64, 128, 4, 4, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("leaves", [1, 2, 8])
def test_tma_loop_gives_the_pointer_loops_bits(dtype, leaves):
    from megatron_iso.ops.gemm.gemm_triton import CONFIGS
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as f

    x, w = _rand((300, 2048), dtype, 47), _rand((640, 2048), dtype, 48)  # partial tiles in M and N
    base = f(x, w, leaves, parallel=1, config=CONFIGS[dtype]).view(torch.int32)
    bk = CONFIGS[dtype].block_k
    for bm, bn, warps, stages, park_from in TMA_TILES:
        cfg = C(bm, bn, bk, warps, stages if dtype != torch.float32 else 2, park_from=park_from, loop="tma")
        for parallel in {1, min(leaves, 2)}:
            got = f(x, w, leaves, parallel=parallel, config=cfg).view(torch.int32)
            assert torch.equal(got, base), (cfg, parallel)


# (BM, BN, warps, stages, park_from) of the Gluon loop: one TMA pipeline across the leaves, wgmma kept in flight.
GLUON_TILES = [(128, 128, 8, 4, 1), (128, 128, 4, 3, 0), (128, 256, 8, 3, 0), (128, 64, 8, 4, 1), (64, 128, 4, 4, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
def test_gluon_loop_gives_the_pointer_loops_bits(dtype, leaves):
    from megatron_iso.ops.gemm.gemm_triton import CONFIGS
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as f

    x, w = _rand((300, 2048), dtype, 49), _rand((640, 2048), dtype, 50)  # partial tiles in M and N
    bk = CONFIGS[dtype].block_k
    for out_dtype in (torch.float32, dtype):
        base = f(x, w, leaves, parallel=1, config=CONFIGS[dtype], out_dtype=out_dtype)
        for bm, bn, warps, stages, park_from in GLUON_TILES:
            cfg = C(bm, bn, bk, warps, stages, park_from=park_from, loop="gluon")
            for parallel in {1, min(leaves, 2)}:
                got = f(x, w, leaves, parallel=parallel, config=cfg, out_dtype=out_dtype)
                assert torch.equal(bits(got), bits(base)), (cfg, parallel, out_dtype)


def test_selected_configs_row_bits_independent_of_m():
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as f

    x, w = _rand((1024, 4096), torch.bfloat16, 43), _rand((512, 4096), torch.bfloat16, 44)
    for leaves in (1, 8):
        full = f(x, w, leaves).view(torch.int32)  # wide (leaves=1) or default tile
        for m in (1, 3, 16, 17, 64, 65, 200):  # 16-row tiles up to 16, 64-row up to 64, then large-M tiles
            assert torch.equal(f(x[:m], w, leaves).view(torch.int32), full[:m]), (leaves, m)
    # An LM-head-wide one-leaf GEMM takes its own tile at M <= 16.
    from megatron_iso.ops.gemm.gemm_triton import WIDE_N

    x, w = _rand((64, 512), torch.bfloat16, 45), _rand((WIDE_N, 512), torch.bfloat16, 46)
    full = f(x, w, 1).view(torch.int32)
    for m in (1, 16, 17):
        assert torch.equal(f(x[:m], w, 1).view(torch.int32), full[:m]), m


@pytest.mark.parametrize("leaves", [1, 2])
def test_output_past_2_pow_31_elements(leaves):
    # An LM head over 14k tokens writes 14336 x 151936 > 2^31 logits; int32 offsets wrapped to an
    # illegal address (hybrid RL step on the H200). The last rows must be the rows computed alone.
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton

    M, N, K = 14336, 151936, 128
    x = _rand((M, K), torch.bfloat16, 41)
    w = _rand((N, K), torch.bfloat16, 42)
    out = leaf_tree_linear_triton(x, w, leaves)
    for rows in (slice(M - 3, M), slice(0, 2)):
        alone = leaf_tree_linear_triton(x[rows], w, leaves)
        assert torch.equal(out[rows].view(torch.int32), alone.view(torch.int32))
