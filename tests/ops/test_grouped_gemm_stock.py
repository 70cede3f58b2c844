"""The stock static grouped GEMM (``ops.gemm.grouped_stock``: the performance profile's expert GEMMs in serving
steps): torch's grouped GEMM and the masked fallback give each row its own expert's product (against one library
GEMM per expert, within the dtype's rounding) over empty, one-row and all-in-one experts; neither reads the counts
on the host; bad operands are refused with the shapes named."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.gemm import grouped_stock
from megatron_iso.ops.gemm.grouped_stock import grouped_mm_static, library_kernel_serves, masked_dense
from megatron_iso.testing.host_reads import HostReadCounter

COUNTS = [[4, 0, 1, 7], [0, 0, 12, 0], [1, 1, 1, 1]]


def _case(dtype, counts, n=24, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(len(counts), n, k, generator=g) / 8).to(dtype)
    x = torch.randn(sum(counts), k, generator=g).to(dtype)
    return x, w, torch.tensor(counts)


def _per_expert(x, w, counts):
    return torch.cat([rows @ w[e].t() for e, rows in enumerate(torch.split(x, counts.tolist()))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_each_row_gets_its_own_experts_product(dtype, counts):
    x, w, c = _case(dtype, counts)
    ref = _per_expert(x, w, c).float()
    tol = {"rtol": 0.0, "atol": 1e-5 if dtype == torch.float32 else 2e-2}
    assert library_kernel_serves(x, w), "torch's grouped GEMM should serve CPU operands of 16-byte rows"
    for name, out in (("grouped_mm", grouped_mm_static(x, w, c)), ("masked", masked_dense(x, w, c))):
        assert out.dtype == dtype and out.shape == ref.shape, name
        torch.testing.assert_close(out.float(), ref, **tol, msg=name)


def test_no_host_read_of_the_counts():
    x, w, c = _case(torch.bfloat16, [4, 0, 1, 7])
    real = grouped_stock.library_kernel_serves
    with HostReadCounter() as counter:
        counter.seed(x, w, c)
        grouped_mm_static(x, w, c)
        grouped_stock.library_kernel_serves = lambda *a: False
        try:
            grouped_mm_static(x, w, c)
        finally:
            grouped_stock.library_kernel_serves = real
        assert counter.reads == []
        torch.split(x, c.tolist())  # the per-expert split the static path avoids: the counter sees it
        assert counter.reads


def test_layouts_the_library_kernel_cannot_take_fall_back():
    x, w, c = _case(torch.float32, [2, 1], n=8, k=6)  # 24-byte rows: not a multiple of 16
    assert not library_kernel_serves(x, w)
    torch.testing.assert_close(grouped_mm_static(x, w, c), _per_expert(x, w, c), rtol=0.0, atol=1e-5)


def test_bad_operands_are_refused():
    x, w, c = _case(torch.float32, [2, 1])
    with pytest.raises(ValueError, match=r"weights \[E, N, K\] with the same K"):
        grouped_mm_static(x[:, :8], w, c)
    with pytest.raises(ValueError, match=r"counts must be \[E=2\]"):
        grouped_mm_static(x, w, torch.tensor([3]))
    with pytest.raises(TypeError, match="must match"):
        grouped_mm_static(x.bfloat16(), w, c)
