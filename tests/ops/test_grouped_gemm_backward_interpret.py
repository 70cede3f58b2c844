"""The grouped expert GEMM's backward kernels on CPU under TRITON_INTERPRET=1 (tiny shapes; skipped without triton).

What the interpreter can show: the device-side schedule of both kernels (expert M-tiles from the counts' prefix sums,
empty and one-row experts, programs past the last tile, an expert's rows contracted to its own weight gradient, zeros
for an expert without rows), that both gradients are those of the per-expert matmuls (fp32 accumulation rounded
once to bf16: within one bf16 rounding of an fp64 reference), that a repeated call gives the same bits, and that the
autograd function routes CUDA-like 16-bit calls through it. Speed and the real tiles: tests/gpu/test_grouped_gemm.py.
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
    from megatron_iso.ops.gemm.grouped_backward_triton import grouped_linear_backward_triton

    torch.manual_seed(0)
    K, N = 40, 24  # neither a multiple of the interpreter tiles: masked edges in both kernels
    counts = torch.tensor([17, 0, 1, 33, 2, 0])
    T = int(counts.sum())
    ws = [torch.randn(N, K).bfloat16() for _ in range(len(counts))]  # separate tensors: the address table
    x = torch.randn(T, K).bfloat16()
    g = torch.randn(T, N)  # fp32, as the forward's output gradient arrives
    gx, gw = grouped_linear_backward_triton(g, x, ws, counts)
    assert gx.dtype == torch.bfloat16 and gx.shape == (T, K) and gw.dtype == torch.bfloat16 and gw.shape == (6, N, K)
    g16 = g.bfloat16().double()
    start = 0
    for e, c in enumerate(counts.tolist()):
        rows = slice(start, start + c)
        ref_x = g16[rows] @ ws[e].double()
        ref_w = g16[rows].t() @ x[rows].double()
        # fp32 accumulation of exact bf16 products, one rounding to bf16: at most one bf16 ulp (2^-8 relative)
        # plus the fp32 sum's error, from the fp64 result
        assert ((gx[rows].double() - ref_x).abs() <= ref_x.abs() * 2**-7 + 1e-5).all(), e
        assert ((gw[e].double() - ref_w).abs() <= ref_w.abs() * 2**-7 + 1e-5).all(), e
        if c == 0:
            assert torch.equal(gw[e], torch.zeros_like(gw[e])), e
        start += c
    b = lambda t: t.view(torch.int16)
    gx2, gw2 = grouped_linear_backward_triton(g, x, ws, counts)
    assert torch.equal(b(gx), b(gx2)) and torch.equal(b(gw), b(gw2))
    only_w = grouped_linear_backward_triton(g, x, ws, counts, need_x=False)
    assert only_w[0] is None and torch.equal(b(only_w[1]), b(gw))
    from megatron_iso.ops.gemm.grouped_backward_triton import wgrad_backend
    assert wgrad_backend(x) == "triton"  # torch's grouped GEMM only on a CUDA device of capability >= 9.0
    try:
        grouped_linear_backward_triton(g, x, ws, counts, wgrad="cublas")
        raise AssertionError("wgrad='cublas' was accepted")
    except ValueError as exc:
        assert "wgrad='cublas'" in str(exc) and "grouped_mm" in str(exc), exc
    print("ok")
    """
)


def test_grouped_backward_kernels_under_interpreter():
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
