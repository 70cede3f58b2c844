"""The grouped leaf-tree GEMM kernel on CPU under TRITON_INTERPRET=1 (tiny shapes; skipped without triton).

What the interpreter can show: the device-side tile schedule (prefix sums of per-expert tiles, empty
experts, one-row experts, programs past the last tile), the weight address table (separate
tensors), and that each expert's rows equal the dense kernel's on that expert alone bit for bit, for
the static and the flat loop with parked tree levels. The grouped kernel puts an expert's first row
at row 0 of a fresh tile, as the dense call does, so this holds even with the interpreter's numpy
dot (whose bits may depend on a row's position in the tile). Row permutations within an expert and
the real tiles are checked on a GPU (tests/gpu/test_grouped_gemm.py). triton 3.6's interpreter
cannot loop to a run-time bound with numpy 2.x; the subprocess patches that one conversion.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.gemm.gemm_triton import INTERPRET_CONFIG, GemmTileConfig, leaf_tree_linear_triton
    from megatron_iso.ops.gemm.grouped import grouped_reference
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton, m_tiles_bound

    b = lambda t: t.view(torch.int32)
    torch.manual_seed(0)
    K, N = 64, 40
    counts = torch.tensor([17, 0, 1, 33, 2, 0])
    static = GemmTileConfig(16, 16, 8, 4, 1, park_from=0, loop="static")
    for dtype in (torch.float32, torch.bfloat16):
        ws = [torch.randn(N, K).to(dtype) for _ in range(len(counts))]  # separate tensors: the address table
        x = torch.randn(int(counts.sum()), K).to(dtype)
        for leaves, cfg in ((1, INTERPRET_CONFIG), (4, INTERPRET_CONFIG), (8, static)):
            out = grouped_leaf_tree_linear_triton(x, ws, counts, leaves, config=cfg)
            start = 0
            for w, c in zip(ws, counts.tolist()):
                if c:
                    dense = leaf_tree_linear_triton(x[start : start + c], w, leaves, config=cfg)
                    assert torch.equal(b(out[start : start + c]), b(dense)), (dtype, leaves, c)
                start += c
            ref = grouped_reference(x, ws, counts, leaves)
            assert float((out - ref).abs().max()) < 1e-4, (dtype, leaves)
        # stacked [E, N, K] weights, and all rows in one expert
        W = torch.stack(ws)
        one = torch.tensor([0, 0, 0, int(counts.sum()), 0, 0])
        assert torch.equal(b(grouped_leaf_tree_linear_triton(x, W, one, 4)), b(leaf_tree_linear_triton(x, W[3], 4)))
    # no rows at all
    assert grouped_leaf_tree_linear_triton(x[:0], ws, torch.zeros(6, dtype=torch.long), 4).shape == (0, N)
    # the grid bound is never below the true tile count
    for t, e, bm in ((53, 6, 16), (1, 128, 64), (512, 128, 64), (131072, 128, 128)):
        assert m_tiles_bound(t, e, bm) >= -(-t // bm)
    print("ok")
    """
)


def test_grouped_kernel_under_interpreter():
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
