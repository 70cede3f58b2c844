"""ops.moe: router softmax, top-k routing (ties to the lowest expert index) and the routed combine
are per-token functions: bitwise the same for a row alone or inside any batch."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.moe import combine_routed, router_probs, top_k_route
from megatron_iso.testing.bits import bits


def test_ties_go_to_the_lowest_expert_index_and_experts_come_out_ascending():
    logits = torch.zeros(4, 8)
    logits[0, [6, 2, 5]] = 1.0  # three-way tie for two places: experts 2 and 5
    logits[1] = 0.5  # all equal: experts 0 and 1
    logits[2, 7], logits[2, 3] = 3.0, 2.0  # no tie: order by score, reported ascending
    logits[3, [4, 1]] = -1.0  # six-way tie among the rest: 0 and 2
    w, e = top_k_route(router_probs(logits), 2, normalize=True)
    assert e.tolist() == [[2, 5], [0, 1], [3, 7], [0, 2]]
    assert torch.equal(w[0, 0], w[0, 1]) and w[2, 1] > w[2, 0]


def test_renormalisation_and_plain_top_k():
    g = torch.Generator().manual_seed(0)
    probs = router_probs(torch.randn(5, 16, generator=g))
    w_raw, e = top_k_route(probs, 4, normalize=False)
    w_norm, e2 = top_k_route(probs, 4, normalize=True)
    assert torch.equal(e, e2)
    assert torch.equal(w_raw, probs.gather(1, e))
    assert torch.allclose(w_norm.sum(-1), torch.ones(5), atol=1e-6)
    assert torch.allclose(router_probs(torch.randn(5, 16, generator=g)).sum(-1), torch.ones(5), atol=1e-6)


def test_route_and_combine_are_batch_invariant():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 64, generator=g) * 3
    y = torch.randn(37, 8, 48, generator=g)
    probs = router_probs(logits)
    w, e = top_k_route(probs, 8, normalize=True)
    out = combine_routed(y, w)
    perm = torch.randperm(37, generator=g)
    for rows in ([5], [0, 36], perm.tolist()):
        p = router_probs(logits[rows])
        wr, er = top_k_route(p, 8, normalize=True)
        assert torch.equal(bits(p), bits(probs[rows]))
        assert torch.equal(er, e[rows]) and torch.equal(bits(wr), bits(w[rows]))
        assert torch.equal(bits(combine_routed(y[rows], wr)), bits(out[rows]))


def test_accuracy_against_float64():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 128, generator=g) * 4
    ref = torch.softmax(logits.double(), -1)
    assert float((router_probs(logits).double() - ref).abs().max()) < 1e-7
    y, w = torch.randn(9, 8, 32, generator=g), torch.rand(9, 8, generator=g)
    exact = (y.double() * w.double().unsqueeze(-1)).sum(1)
    assert float((combine_routed(y, w).double() - exact).abs().max()) < 1e-5


@pytest.mark.parametrize("k", [0, 9])
def test_bad_top_k_names_the_field(k):
    with pytest.raises(ValueError, match="moe_router_topk"):
        top_k_route(torch.rand(2, 8), k, normalize=True)


def test_router_rejects_low_precision_logits():
    with pytest.raises(TypeError, match="fp32"):
        router_probs(torch.rand(2, 8).bfloat16())
