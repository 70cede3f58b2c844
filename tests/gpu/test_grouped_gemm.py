"""Grouped leaf-tree GEMM (MoE experts) on the GPU: the invariance proof, bit patterns compared.

Claim: the grouped kernel gives each expert's rows exactly the bits the dense Triton leaf-tree GEMM
gives on that expert's rows alone. Since the dense result of a row depends on nothing but the row
and the weight (tests/gpu/test_gemm_tiles.py, test_triton_ops.py), a row's grouped result depends on
nothing but the row and its expert's weight: not on how many rows any expert received.
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


def _per_expert_dense(x, ws, counts, leaves):
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton

    parts, start = [], 0
    for w, c in zip(ws, counts, strict=True):
        parts.append(leaf_tree_linear_triton(x[start : start + c], w, leaves))
        start += c
    return torch.cat(parts)


# Varying counts: empty experts, one-row experts, a count just over a 64- and a 128-row tile, a large one.
COUNTS = [0, 1, 65, 129, 0, 7, 300, 1, 64, 128, 2, 0, 1000, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "n", "leaves"), [(2048, 1536, 1), (2048, 1536, 8), (768, 2048, 4), (512, 384, 2)])
def test_grouped_equals_per_expert_dense_bitwise(dtype, k, n, leaves):
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    ws = [_rand((n, k), dtype, 100 + e) for e in range(len(COUNTS))]  # separate tensors, as Megatron keeps them
    x = _rand((sum(COUNTS), k), dtype, 7)
    counts = torch.tensor(COUNTS, device="cuda")
    out = grouped(x, ws, counts, leaves)
    assert torch.equal(bits(out), bits(_per_expert_dense(x, ws, COUNTS, leaves)))
    # the same weights stacked [E, N, K]
    assert torch.equal(bits(grouped(x, torch.stack(ws), counts, leaves)), bits(out))
    # accuracy against fp64
    ref = torch.cat([x[s : s + c].double() @ w.double().t() for s, c, w in _spans(COUNTS, ws)])
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < (1e-5 if dtype == torch.float32 else 1e-3), rel


def _spans(counts, ws):
    start = 0
    for c, w in zip(counts, ws, strict=True):
        yield start, c, w
        start += c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_independent_of_other_experts_and_of_order(dtype):
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    k, n, leaves = 2048, 1024, 8
    ws = torch.stack([_rand((n, k), dtype, 200 + e) for e in range(6)])
    counts = [40, 0, 1, 200, 17, 90]
    x = _rand((sum(counts), k), dtype, 8)
    full = grouped(x, ws, torch.tensor(counts, device="cuda"), leaves)
    # rows permuted within each expert
    g = torch.Generator(device="cuda").manual_seed(9)
    perm = torch.cat([s + torch.randperm(c, device="cuda", generator=g) for s, c, _ in _spans(counts, ws)])
    assert torch.equal(bits(grouped(x[perm], ws, torch.tensor(counts, device="cuda"), leaves)), bits(full[perm]))
    # expert 3's rows alone (other experts empty), and its first row alone
    alone = torch.tensor([0, 0, 0, 200, 0, 0], device="cuda")
    assert torch.equal(bits(grouped(x[41:241], ws, alone, leaves)), bits(full[41:241]))
    one = torch.tensor([0, 0, 0, 1, 0, 0], device="cuda")
    assert torch.equal(bits(grouped(x[41:42], ws, one, leaves)), bits(full[41:42]))
    # other experts' counts changed (rows moved between experts 4 and 5): expert 3 unchanged
    moved = torch.tensor([40, 0, 1, 200, 50, 57], device="cuda")
    assert torch.equal(bits(grouped(x, ws, moved, leaves)[:241]), bits(full[:241]))


def test_every_bf16_tile_with_block_k_64_gives_the_same_bits():
    from megatron_iso.ops.gemm.gemm_triton import CONFIGS, selectable_tiles
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    dt = torch.bfloat16
    ws = torch.stack([_rand((640, 2048), dt, 300 + e) for e in range(5)])
    counts = torch.tensor([3, 0, 150, 64, 1], device="cuda")
    x = _rand((218, 2048), dt, 10)
    for leaves in (1, 8):
        base = grouped(x, ws, counts, leaves, config=CONFIGS[dt])
        for cfg in (*selectable_tiles(dt, descriptor_loops=False)[1:], C(128, 64, 64, 4, 4)):
            if leaves > 1 and cfg.block_n >= 256:
                cfg = C(**{**cfg.__dict__, "num_stages": 2})  # the 8-leaf park buffer needs the smem
            assert torch.equal(bits(grouped(x, ws, counts, leaves, config=cfg)), bits(base)), (leaves, cfg)


def test_empty_and_degenerate_inputs():
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    ws = torch.stack([_rand((256, 512), torch.bfloat16, 400 + e) for e in range(4)])
    out = grouped(_rand((0, 512), torch.bfloat16, 1), ws, torch.zeros(4, dtype=torch.long, device="cuda"), 8)
    assert out.shape == (0, 256) and out.dtype == torch.float32
    x = _rand((1, 512), torch.bfloat16, 2)
    one = grouped(x, ws, torch.tensor([0, 0, 0, 1], device="cuda"), 8)
    assert torch.equal(bits(one), bits(_per_expert_dense(x, [ws[3]], [1], 8)))
    # int32 counts on the host work too
    assert torch.equal(bits(grouped(x, ws, torch.tensor([0, 0, 0, 1], dtype=torch.int32), 8)), bits(one))


def test_bad_inputs_are_refused():
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    ws = torch.stack([_rand((256, 512), torch.bfloat16, 500 + e) for e in range(2)])
    x = _rand((5, 512), torch.bfloat16, 3)
    c = torch.tensor([2, 3])
    with pytest.raises(TypeError, match="dtype"):
        grouped(x.float(), ws, c, 8)
    with pytest.raises(ValueError, match="sum to 4"):
        grouped(x, ws, torch.tensor([2, 2]), 8)
    with pytest.raises(ValueError, match="block_k=32"):
        grouped(x, ws, c, 8, config=C(128, 128, 32, 8, 4))
    with pytest.raises(ValueError, match="leaf depth"):
        grouped(_rand((5, 768), torch.bfloat16, 4), torch.stack([_rand((256, 768), torch.bfloat16, 5)] * 2), c, 8)
    with pytest.raises(ValueError, match="same strides"):
        grouped(x, [ws[0], ws[1].t().contiguous().t()], c, 8)


def test_cuda_graph_capture_and_replay():
    """No host sync inside: the call captures into a CUDA graph, and replays follow new counts."""
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    ws = [_rand((512, 1024), torch.bfloat16, 600 + e) for e in range(8)]
    x = _rand((96, 1024), torch.bfloat16, 6)
    counts = torch.tensor([10, 0, 30, 1, 5, 0, 40, 10], device="cuda")
    grouped(x, ws, counts, 8)  # warm up: compile, address table
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = grouped(x, ws, counts, 8)
    torch.cuda.current_stream().wait_stream(s)
    new = [0, 50, 0, 6, 0, 40, 0, 0]
    counts.copy_(torch.tensor(new))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(_per_expert_dense(x, ws, new, 8)))


def test_iso_experts_grouped_equal_the_per_expert_loop_on_gpu():
    """The model path: IsoSequentialExperts' two grouped launches == its per-expert loop (fwd and bwd)."""
    pytest.importorskip("megatron.core")
    from tests.models.test_moe_grouped_experts import _loop_vs_grouped_cuda

    for dtype in ("bf16", "fp32"):
        (loop, grouped), can_group = _loop_vs_grouped_cuda(dtype)
        assert can_group, "the CUDA forward must take the grouped path"
        assert torch.equal(bits(grouped[0]), bits(loop[0])), (dtype, "forward")
        assert torch.equal(bits(grouped[1]), bits(loop[1])), (dtype, "grad of the tokens")
        for i, (a, b) in enumerate(zip(grouped[2], loop[2], strict=True)):
            assert torch.equal(bits(a), bits(b)), (dtype, f"weight grad {i}")


@pytest.mark.parametrize(
    "dtype,wgrad",
    [(torch.bfloat16, "triton"), (torch.float16, "triton"), (torch.bfloat16, "grouped_mm"), (torch.bfloat16, "auto")],
)
def test_grouped_backward_kernels_match_per_expert_matmuls(dtype, wgrad):
    """The backward's two grouped launches (dgrad, wgrad; the weight gradient by the Triton kernel or torch's grouped
    GEMM): each expert's gradients are its own rows' matmuls (fp32 accumulation rounded once: within a 16-bit
    rounding of an fp32 computation of the same inputs), an expert without rows gets zeros, and a second call gives
    the same bits (deterministic)."""
    from megatron_iso.ops.gemm.grouped_backward_triton import grouped_linear_backward_triton

    if wgrad == "grouped_mm" and not (hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("torch._grouped_mm needs this torch to have it and a device of compute capability >= 9.0")

    k, n = 768, 1536
    ws = [_rand((n, k), dtype, 100 + e) / k**0.5 for e in range(len(COUNTS))]
    t = sum(COUNTS)
    x = _rand((t, k), dtype, 7)
    g = _rand((t, n), torch.float32, 8)
    counts = torch.tensor(COUNTS, device="cuda")
    gw0 = torch.full((len(COUNTS), n, k), float("nan"), dtype=dtype, device="cuda")  # leaves NaN in freed memory
    del gw0
    gx, gw = grouped_linear_backward_triton(g, x, ws, counts, wgrad=wgrad)
    gx2, gw2 = grouped_linear_backward_triton(g, x, ws, counts, wgrad=wgrad)
    assert torch.equal(bits(gx), bits(gx2)) and torch.equal(bits(gw), bits(gw2))
    g16 = g.to(dtype).float()
    start = 0
    for e, c in enumerate(COUNTS):
        ref_x = g16[start : start + c] @ ws[e].float()
        ref_w = g16[start : start + c].t() @ x[start : start + c].float()
        tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
        assert ((gx[start : start + c].float() - ref_x).abs() <= ref_x.abs() * tol + 1e-4).all(), e
        assert ((gw[e].float() - ref_w).abs() <= ref_w.abs() * tol + 1e-4).all(), e
        if c == 0:
            assert not gw[e].any(), e
        start += c


def test_grouped_linear_autograd_uses_the_grouped_backward():
    """grouped_linear's autograd on CUDA bf16: the gradients are the grouped kernels' (bitwise), not the loop's."""
    from megatron_iso.ops.gemm.grouped import grouped_linear
    from megatron_iso.ops.gemm.grouped_backward_triton import grouped_linear_backward_triton

    k, n = 512, 384
    ws = [(_rand((n, k), torch.bfloat16, 200 + e) / k**0.5).requires_grad_(True) for e in range(len(COUNTS))]
    x = _rand((sum(COUNTS), k), torch.bfloat16, 9).requires_grad_(True)
    counts = torch.tensor(COUNTS, device="cuda")
    out = grouped_linear(x, ws, counts, leaves=1)
    g = _rand(out.shape, torch.float32, 10)
    out.backward(g)
    gx, gw = grouped_linear_backward_triton(g, x.detach(), [w.detach() for w in ws], counts)
    assert torch.equal(bits(x.grad), bits(gx))
    for e, w in enumerate(ws):
        assert torch.equal(bits(w.grad), bits(gw[e])), e
