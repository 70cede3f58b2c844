"""The grouped Triton kernel on a static decode bucket (CPU, TRITON_INTERPRET=1; skipped without triton).

A CUDA-graph decode step dispatches ``B * k`` slots for a bucket of B rows, n of them real and the rest
padding, with the counts on the device; the eager step dispatches the ``n * k`` slots of its real rows.
The kernel's grid depends on T and E only, so the static launch is this same kernel; the claim checked
here is that every real slot gets the eager launch's bits: padding rows (their slots sort after the
real ones of each expert, so a real row keeps its place in its expert's tiles) and the other experts'
rows change nothing, for empty experts, a one-row expert, every real row in one expert pair, with 4
leaves (the flat loop, parked tree levels) and 8 (the static loop). bf16 dots run in fp32 under the
interpreter (the kernel's CAST_F32). Real tiles: tests/gpu/test_moe_static_graph.py.
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
    from megatron_iso.ops.gemm.gemm_triton import INTERPRET_CONFIG, GemmTileConfig
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    b = lambda t: t.view(torch.int32)
    E, K, N, TOPK = 6, 64, 40, 2


    def dispatch(x, experts):
        # The dispatcher's slot order: per token ascending experts, then a stable sort by expert.
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(E, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        return x.repeat_interleave(TOPK, 0)[order], counts, order


    def per_slot(x, experts, ws, leaves, cfg):
        xs, counts, order = dispatch(x, experts)
        out = grouped(xs, ws, counts, leaves, config=cfg)
        back = torch.empty_like(out)
        back[order] = out
        return back.reshape(x.shape[0], TOPK, N), counts


    g = torch.Generator().manual_seed(0)
    static = GemmTileConfig(16, 16, 8, 4, 1, park_from=0, loop="static")
    empty = one_row = 0
    for dtype in (torch.float32, torch.bfloat16):
        ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(E)]
        bucket = 24
        x = torch.randn(bucket, K, generator=g).to(dtype)
        x[20:] = 0  # padding rows as a bucket holds them, and garbage ones
        x[17:20] = 1e4
        rand = torch.sort(torch.rand(bucket, E, generator=g).topk(TOPK, dim=1).indices, dim=1).values
        routings = {
            "random": rand,
            "skewed": torch.where(torch.arange(bucket).unsqueeze(1) < 9, torch.tensor([1, 4]), rand),
            "one expert pair": torch.tensor([2, 3]).expand(bucket, TOPK).clone(),
        }
        for name, experts in routings.items():
            for leaves, cfg in ((4, INTERPRET_CONFIG), (8, static)):
                full, counts = per_slot(x, experts, ws, leaves, cfg)
                for n in (1, 5, 16):
                    eager, eager_counts = per_slot(x[:n], experts[:n], ws, leaves, cfg)
                    assert torch.equal(b(full[:n]), b(eager)), (dtype, name, leaves, n)
                    empty += int((eager_counts == 0).sum())
                    one_row += int((eager_counts == 1).sum())
    assert empty > 0 and one_row > 0, (empty, one_row)
    print("ok")
    """
)


def test_grouped_kernel_on_a_static_bucket_gives_the_eager_bits():
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
