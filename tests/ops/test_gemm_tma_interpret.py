"""The TMA loop of the leaf-tree GEMM (``GemmTileConfig(loop="tma")``) on the CPU, TRITON_INTERPRET=1 (skipped
without triton).

Claimed and checked bit for bit (bit patterns): the TMA loop == the flat and static pointer loops for every
output element, at M and N that leave partial tiles (TMA fills the rows and columns past them with zeros where
the pointer loops load a neighbour row), 1, 2, 4 and 8 leaves, one or several programs per tile (subtrees and
the combine kernel), level 0 of the tree in registers or parked, bf16 (its dots run in fp32 under the
interpreter) and fp32. The interpreter shows the logic (which K tiles each leaf takes, the tree, the subtree
offsets); the compiled kernel's bits against the pointer loops are tests/gpu/test_gemm_tiles.py's.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig, leaf_tree_linear_triton as f

    b = lambda t: t.view(torch.int32)
    flat = GemmTileConfig(16, 16, 8, 4, 1, park_from=1)
    static = GemmTileConfig(16, 16, 8, 4, 1, park_from=0, loop="static")
    g = torch.Generator().manual_seed(3)
    checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        for M, N, K in ((37, 40, 256), (16, 16, 128), (5, 33, 64)):
            x = torch.randn(M, K, generator=g).to(dtype)
            w = torch.randn(N, K, generator=g).to(dtype)
            for leaves in (1, 2, 4, 8):
                want = f(x, w, leaves, parallel=1, config=static)
                assert torch.equal(b(f(x, w, leaves, parallel=1, config=flat)), b(want)), ("flat", M, N, leaves)
                for park_from in (0, 1):
                    tma = GemmTileConfig(16, 16, 8, 4, 1, park_from=park_from, loop="tma")
                    for parallel in {1, min(leaves, 2), leaves}:
                        got = f(x, w, leaves, parallel=parallel, config=tma)
                        assert torch.equal(b(got), b(want)), (dtype, M, N, K, leaves, park_from, parallel)
                        checked += 1
    print("ok", checked)
    """
)


def test_tma_loop_equals_the_pointer_loops() -> None:
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
    assert int(res.stdout.split("ok")[-1]) == 2 * 3 * (2 + 4 + 6 + 6)  # every (dtype, shape, leaves, park, parallel)


def test_loop_names_and_what_tma_refuses() -> None:
    from megatron_iso.ops.gemm import gemm_tma_triton as tma
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig

    with pytest.raises(ValueError, match=r"loop='tiled' must be one of \('static', 'flat', 'tma', 'gluon'\)"):
        GemmTileConfig(16, 16, 8, 4, 1, loop="tiled")
    x = torch.zeros(8, 72, dtype=torch.bfloat16)
    assert tma.tma_supported(x, x) is None
    shifted = torch.zeros(8, 73, dtype=torch.bfloat16)[:, 1:]  # rows of 146 bytes, base 2 bytes past alignment
    assert "16-byte aligned" in tma.tma_supported(shifted, x)
    assert "x needs" in tma.tma_supported(shifted, x)


def test_large_m_selects_a_descriptor_loop_where_the_operands_allow_one() -> None:
    """At large M the dense GEMM runs the Gluon (8 leaves) or TMA (one leaf) tile when its operands can take TMA
    descriptors and falls back to the pointer-loop tile of the same bucket when not (a misaligned view); the
    grouped expert GEMM and the other buckets keep the pointer loops. Bits are the same either way (the GPU tile
    tests hold every selectable tile to the default's)."""
    from megatron_iso.ops.gemm import gemm_triton as gt
    from megatron_iso.ops.gemm.gemm_gluon_triton import gluon_supported
    from megatron_iso.ops.gemm.grouped_triton import grouped_config

    bf = torch.bfloat16
    assert gt.select_config(bf, 4096, 8, 4096, descriptor_loops=True).loop == "gluon"
    assert gt.select_config(bf, 4096, 1, 4096, descriptor_loops=True).loop == "tma"
    assert gt.select_config(bf, 4096, 8, 4096).loop == "flat"
    for m in (1, 64, 256):  # below the large bucket nothing changes
        assert gt.select_config(bf, m, 8, 4096, descriptor_loops=True) == gt.select_config(bf, m, 8, 4096)
    assert gt.select_config(torch.float32, 4096, 8, 4096, descriptor_loops=True).loop == "static"
    assert gt.select_config(torch.float16, 4096, 8, 4096, descriptor_loops=True).loop == "gluon"
    w = torch.zeros(512, 256, dtype=bf)
    if gluon_supported(torch.zeros(4096, 256, dtype=bf), w) is None:
        assert gt._selected_config(torch.zeros(4096, 256, dtype=bf), w, 8).loop == "gluon"
    misaligned = torch.zeros(4096, 257, dtype=bf)[:, 1:]  # rows start 2 bytes past 16-byte alignment
    assert gt._selected_config(misaligned, w, 8) == gt.select_config(bf, 4096, 8, 512)
    assert gt._selected_config(misaligned, w, 1) == gt.select_config(bf, 4096, 1, 512)
    assert {c.loop for c in gt.selectable_tiles(bf, descriptor_loops=False)} <= {"static", "flat"}
    assert {"tma", "gluon"} <= {c.loop for c in gt.selectable_tiles(bf)}
    assert grouped_config(bf, 8 * 4096, 8, 8).loop == "flat"
