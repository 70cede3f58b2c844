"""The fixed tree: the vectorised ``tree_sum_dim`` is the recursive ``tree_sum``, bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.common.tree import tree_sum, tree_sum_dim
from megatron_iso.testing.bits import bits


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 8, 11, 16, 17, 33, 100, 127, 1187, 2374])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_tree_sum_dim_is_the_recursive_tree(n: int, dim: int) -> None:
    g = torch.Generator().manual_seed(n)
    shape = [3, 4, 5]
    shape[dim] = n
    # Wide dynamic range: any change of association order shows in the bits.
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 6)
    assert torch.equal(bits(tree_sum_dim(x, dim)), bits(tree_sum(x.unbind(dim))))


def test_lone_terms_pass_up_unchanged() -> None:
    # n = 3: ((x0) + (x1 + x2)); a lone -0.0 must not become +0.0 by an add of 0.
    x = torch.tensor([[-0.0, -0.0, -0.0]], dtype=torch.float64)
    out = tree_sum_dim(x, 1)
    assert torch.equal(bits(out), bits(torch.tensor([-0.0], dtype=torch.float64)))
    y = torch.tensor([[1e16, 1.0, -1e16, 1.0, 1.0]], dtype=torch.float64)
    assert torch.equal(bits(tree_sum_dim(y, 1)), bits(tree_sum(y.unbind(1))))


def test_vocab_sized_leaf_is_a_few_ops() -> None:
    # A Qwen3 vocab leaf (151936 / 8 terms) used to recurse into tens of thousands of adds.
    x = torch.randn(2, 18992, dtype=torch.float32)
    with torch.profiler.profile() as prof:
        tree_sum_dim(x, -1)
    adds = sum(e.count for e in prof.key_averages() if e.key == "aten::add")
    assert adds <= 16
    assert torch.equal(bits(tree_sum_dim(x, -1)), bits(tree_sum(x.unbind(-1))))


def test_empty_dim_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        tree_sum_dim(torch.zeros(2, 0), 1)
