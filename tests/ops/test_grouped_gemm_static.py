"""The grouped GEMM's static-shape CPU path (``static=True``: CUDA-graph decode steps) gives the eager
path's bits: :func:`grouped_reference_static` equals :func:`grouped_reference` bitwise over empty
experts, one-row experts, all rows in one expert and no rows at all, and reads no count on the host."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.gemm.grouped import grouped_linear, grouped_reference, grouped_reference_static
from megatron_iso.testing.bits import bits
from megatron_iso.testing.host_reads import HostReadCounter

COUNTS = [[4, 0, 1, 7], [0, 0, 12, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def _case(dtype, counts, n=24, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(len(counts), n, k, generator=g) / 8).to(dtype)
    x = torch.randn(sum(counts), k, generator=g).to(dtype)
    return x, w, torch.tensor(counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leaves", [1, 8])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_static_reference_equals_the_eager_reference(dtype, leaves, counts):
    x, w, c = _case(dtype, counts)
    ref = grouped_reference(x, w, c, leaves)
    assert torch.equal(bits(grouped_reference_static(x, w, c, leaves)), bits(ref))
    assert torch.equal(bits(grouped_linear(x, w, c, leaves=leaves, static=True)), bits(ref))


def test_static_reference_reads_no_count_on_the_host():
    x, w, c = _case(torch.bfloat16, [4, 0, 1, 7])
    with HostReadCounter() as counter:
        counter.seed(x, w, c)
        grouped_linear(x, w, c, leaves=8, static=True)
        static_reads = list(counter.reads)
        counter.clear()
        grouped_linear(x, w, c, leaves=8)
        eager_reads = list(counter.reads)
    assert static_reads == []
    assert eager_reads, "the counter must see the eager path's reads of the counts"


def test_static_needs_the_correctness_profile():
    x, w, c = _case(torch.float32, [2, 1])
    with pytest.raises(ValueError, match="static=True needs profile='correctness'"):
        grouped_linear(x, w, c, profile="performance", static=True)
