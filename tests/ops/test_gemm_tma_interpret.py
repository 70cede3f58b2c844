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

    with pytest.raises(
        ValueError, match=r"loop='tiled' must be one of \('static', 'flat', 'tma', 'gluon', 'gluon_pairs'\)"
    ):
        GemmTileConfig(16, 16, 8, 4, 1, loop="tiled")
    with pytest.raises(ValueError, match="persistent=True needs a Gluon loop"):
        GemmTileConfig(16, 16, 8, 4, 1, loop="tma", persistent=True)
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
    from megatron_iso.ops.gemm.gemm_gluon import gluon_supported
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


PAIRS_SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    import triton
    import triton.language as tl
    from megatron_iso.ops.gemm.leaf_steps_triton import _pair_k_tile, _tree_step

    @triton.jit
    def order_kernel(out_ptr, leaf_tiles, total, BLOCK: tl.constexpr):
        seq = tl.arange(0, BLOCK)
        tl.store(out_ptr + seq, _pair_k_tile(seq, leaf_tiles), mask=seq < total)

    @triton.jit
    def trees_kernel(leaf_ptr, park_a, park_b, out_a, out_b, LEAVES: tl.constexpr, LOG2: tl.constexpr,
                     BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < BLOCK
        s0 = tl.zeros((BLOCK,), tl.float32)
        for i in range(LEAVES):  # the single-leaf loops: level 0 in registers, the rest parked
            v = tl.load(leaf_ptr + i * BLOCK + offs)
            s0 = _tree_step(v, s0, i, park_a + offs, out_a + offs, ok, BLOCK, LEAVES, LOG2, 1)
        for j in range(LEAVES // 2):  # gluon_pairs: two leaves summed, then a tree of LEAVES / 2 parked nodes
            a = tl.load(leaf_ptr + 2 * j * BLOCK + offs)
            b = tl.load(leaf_ptr + (2 * j + 1) * BLOCK + offs)
            _tree_step(a + b, s0, j, park_b + offs, out_b + offs, ok, BLOCK, LEAVES // 2, LOG2 - 1, 0)

    def balanced(parts):
        if len(parts) == 1:
            return parts[0]
        h = len(parts) // 2
        return balanced(parts[:h]) + balanced(parts[h:])

    # consumption order: each leaf's K tiles in increasing order, two leaves alternating, every tile once
    for leaf_tiles, pairs in ((1, 1), (3, 2), (8, 4)):
        total = 2 * pairs * leaf_tiles
        got = torch.full((128,), -1, dtype=torch.int32)
        order_kernel[(1,)](got, leaf_tiles, total, BLOCK=128)
        want = [p * 2 * leaf_tiles + (r % 2) * leaf_tiles + r // 2 for p in range(pairs) for r in range(2 * leaf_tiles)]
        assert got[:total].tolist() == want, (leaf_tiles, got[:total].tolist())

    g = torch.Generator().manual_seed(5)
    bits = lambda t: t.view(torch.int32)
    for leaves in (2, 4, 8, 16):
        log2 = leaves.bit_length() - 1
        # magnitudes spread over 2^-20 .. 2^20: any other order of the adds rounds differently somewhere
        vals = torch.randn(leaves, 64, generator=g) * torch.exp2(torch.randint(-20, 21, (leaves, 64), generator=g))
        park_a = torch.zeros(max(1, log2 - 1), 64)
        park_b = torch.zeros(max(1, log2 - 1), 64)
        out_a, out_b = torch.empty(64), torch.empty(64)
        trees_kernel[(1,)](vals, park_a, park_b, out_a, out_b, LEAVES=leaves, LOG2=log2, BLOCK=64)
        tree = balanced(list(vals))
        assert torch.equal(bits(out_a), bits(tree)) and torch.equal(bits(out_b), bits(tree)), leaves
        if leaves >= 4:
            serial = vals[0].clone()
            for v in vals[1:]:
                serial = serial + v
            assert not torch.equal(bits(serial), bits(tree)), leaves  # the data can tell the orders apart
    print("ok")
    """
)


def test_pair_loop_keeps_each_leafs_k_order_and_the_tree() -> None:
    """``GemmTileConfig(loop="gluon_pairs")`` walks two leaves' K tiles alternately and sums the pair before the rest
    of the tree: its load order visits each leaf's tiles in K order, and its tree (pair sums, then a balanced tree
    of them with every level parked) gives the balanced leaf tree's bits at 2-16 leaves, as the single-leaf loops'
    tree step does. The compiled kernel's bits: tests/gpu/test_gemm_tiles.py."""
    res = run_interpreted(PAIRS_SCRIPT, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
