"""The training backward of the invariant linears on the GPU: bf16 operands on tensor cores, fp32
accumulation, the same bits on every call, within bf16 rounding of an fp64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_iso.testing.bits import same_bits
from megatron_iso.testing.matmul_log import MatmulLog

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


def _rand(shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * scale).bfloat16()


def _grads(fn, x, w, upstream):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(xr, wr)
    with MatmulLog() as log:
        out.backward(upstream)
    return xr.grad, wr.grad, log


def _check(fn, x, w, upstream, x_exact, w_exact):
    gx, gw, log = _grads(fn, x, w, upstream)
    gx2, gw2, _ = _grads(fn, x, w, upstream)
    assert same_bits(gx, gx2) and same_bits(gw, gw2), "backward is not deterministic"
    assert gx.dtype == gw.dtype == torch.bfloat16
    assert log.matmul_dtypes and all(d[:2] == (torch.bfloat16, torch.bfloat16) for d in log.matmul_dtypes)
    assert tuple(x.shape) not in log.fp32_casts and tuple(w.shape) not in log.fp32_casts
    for got, exact in ((gx, x_exact), (gw, w_exact)):
        rel = (got.double() - exact).norm() / exact.norm()
        assert rel < 2**-7, f"relative error {rel:.3e}"


@pytest.mark.parametrize(("m", "n", "k", "leaves"), [(4096, 1024, 4096, 8), (777, 512, 1536, 1)])
def test_dense_backward(m, n, k, leaves):
    from megatron_iso.ops.gemm import linear

    x, w = _rand((m, k), 0), _rand((n, k), 1, k**-0.5)
    upstream = torch.randn(m, n, device="cuda")
    g64 = upstream.bfloat16().double()
    _check(lambda a, b: linear(a, b, leaves=leaves), x, w, upstream, g64 @ w.double(), g64.t() @ x.double())


def test_grouped_backward():
    from megatron_iso.ops.gemm.grouped import grouped_linear

    counts = torch.tensor([300, 0, 17, 700], device="cuda")
    x, w = _rand((int(counts.sum()), 512), 2), _rand((4, 256, 512), 3, 512**-0.5)
    upstream = torch.randn(x.shape[0], 256, device="cuda")
    g64 = upstream.bfloat16().double()
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    x_exact = torch.cat([g64[a:b] @ w[e].double() for e, (a, b) in enumerate(itertools.pairwise(bounds))])
    w_exact = torch.stack([g64[a:b].t() @ x[a:b].double() for a, b in itertools.pairwise(bounds)])
    gx, gw, log = _grads(lambda a, b: grouped_linear(a, b, counts, leaves=1), x, w, upstream)
    gx2, gw2, _ = _grads(lambda a, b: grouped_linear(a, b, counts, leaves=1), x, w, upstream)
    assert same_bits(gx, gx2) and same_bits(gw, gw2)
    assert all(d[:2] == (torch.bfloat16, torch.bfloat16) for d in log.matmul_dtypes)
    for got, exact in ((gx, x_exact), (gw[[0, 2, 3]], w_exact[[0, 2, 3]])):
        rel = (got.double() - exact).norm() / exact.norm()
        assert rel < 2**-7, f"relative error {rel:.3e}"
    assert bool((gw[1] == 0).all())


@pytest.mark.parametrize(("m", "leaves", "parallel"), [(1, 8, 8), (64, 8, 2), (3000, 8, 1), (3000, 1, 1)])
def test_rounded_output_is_the_fp32_output_rounded(m, leaves, parallel):
    from megatron_iso.ops.gemm import linear
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton

    x, w = _rand((m, 4096), 4), _rand((1536, 4096), 5, 4096**-0.5)
    fp32 = leaf_tree_linear_triton(x, w, leaves, parallel=parallel)
    rounded = leaf_tree_linear_triton(x, w, leaves, parallel=parallel, out_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and same_bits(rounded, fp32.bfloat16())
    assert same_bits(linear(x, w, leaves=leaves, out_dtype=torch.bfloat16), linear(x, w, leaves=leaves).bfloat16())
