"""ops.gemm.grouped on CPU: the grouped op is the per-expert leaf tree (bitwise), an expert's rows do
not depend on the other experts' rows, errors name the bad input, and the registry serves it."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.gemm import leaf_tree_linear
from megatron_iso.ops.gemm.grouped import grouped_linear, grouped_native, grouped_reference
from megatron_iso.registry import lookup
from megatron_iso.testing.bits import bits


def _case(dtype, counts, n=24, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(len(counts), n, k, generator=g) / 8).to(dtype)
    x = torch.randn(sum(counts), k, generator=g).to(dtype)
    return x, w, torch.tensor(counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leaves", [1, 8])
def test_grouped_reference_is_the_per_expert_leaf_tree(dtype, leaves):
    x, w, c = _case(dtype, [4, 0, 1, 7])
    out = grouped_linear(x, w, c, leaves=leaves)
    start = 0
    for e, n in enumerate(c.tolist()):
        assert torch.equal(bits(out[start : start + n]), bits(leaf_tree_linear(x[start : start + n], w[e], leaves)))
        start += n
    # a list of per-expert weights is the same op
    assert torch.equal(bits(grouped_linear(x, list(w.unbind(0)), c, leaves=leaves)), bits(out))


def test_expert_rows_do_not_depend_on_other_experts():
    x, w, c = _case(torch.bfloat16, [3, 5, 2])
    full = grouped_reference(x, w, c, 8)
    # expert 1 alone, and expert 1's rows reversed, with the other experts emptied
    alone = grouped_reference(x[3:8], w, torch.tensor([0, 5, 0]), 8)
    rev = grouped_reference(x[3:8].flip(0), w, torch.tensor([0, 5, 0]), 8)
    assert torch.equal(bits(alone), bits(full[3:8])) and torch.equal(bits(rev), bits(full[3:8].flip(0)))


def test_backward_is_the_per_expert_matmul_backward():
    x, w, c = _case(torch.float32, [2, 0, 3])
    x.requires_grad_(True)
    w.requires_grad_(True)
    grouped_linear(x, w, c, leaves=2).square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    torch.cat([leaf_tree_linear(x2[:2], w2[0], 2), leaf_tree_linear(x2[2:], w2[2], 2)]).square().sum().backward()
    assert torch.equal(bits(x.grad), bits(x2.grad)) and torch.equal(bits(w.grad), bits(w2.grad))
    assert bool((w.grad[1] == 0).all())  # the empty expert gets a zero gradient


def test_native_profile_and_registry():
    x, w, c = _case(torch.float32, [2, 3])
    nat = grouped_linear(x, w, c, profile="performance")
    assert torch.allclose(nat, torch.cat([x[:2] @ w[0].t(), x[2:] @ w[1].t()]))
    assert torch.equal(nat, grouped_native(x, w, c))
    assert lookup("grouped_gemm", "cpu", "correctness").fn is grouped_reference
    assert lookup("grouped_gemm", "cuda", "performance").fn is grouped_native


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (lambda x, w, c: (x, w, torch.tensor([2, 2])), ValueError, "sum to 4 but x has T=5"),
        (lambda x, w, c: (x, w, torch.tensor([6, -1])), ValueError, "negative"),
        (lambda x, w, c: (x, w, torch.tensor([5])), ValueError, "1-D tensor of 2 rows per expert"),
        (lambda x, w, c: (x, w, c.float()), TypeError, "integer"),
        (lambda x, w, c: (x[:, :32], w, c), ValueError, "K=32"),
        (lambda x, w, c: (x, w[0], c), ValueError, r"\[E, N, K\]"),
        (lambda x, w, c: (x, [w[0], w[1][:8]], c), ValueError, r"weights\[1\]"),
        (lambda x, w, c: (x, [], c), ValueError, "empty"),
        (lambda x, w, c: (x.int(), w, c), TypeError, "unsupported dtype"),
    ],
)
def test_bad_inputs_are_named(change, exc, match):
    x, w, c = change(*_case(torch.float32, [2, 3]))
    with pytest.raises(exc, match=match):
        grouped_linear(x, w, c, leaves=2)


def test_bad_leaves_and_profile():
    x, w, c = _case(torch.float32, [2, 3])
    with pytest.raises(ValueError, match="power of two"):
        grouped_linear(x, w, c, leaves=3)
    with pytest.raises(ValueError, match="profile="):
        grouped_linear(x, w, c, profile="fast")
