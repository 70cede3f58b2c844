"""The plain (backward-only) attention formula: batched with padding, it is the per-sequence softmax attention."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_iso.ops.attention import autograd as attn_autograd


def _per_sequence(q, k, v, cu, scale):
    group = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu):
        qs = q[a:b].double().transpose(0, 1)
        ks = k[a:b].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[a:b].double().repeat_interleave(group, 1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("scores_bytes", [1 << 30, 1])  # one padded batch; one sequence per batch
def test_padded_plain_attention_matches_per_sequence_and_is_deterministic(monkeypatch, scores_bytes):
    monkeypatch.setattr(attn_autograd, "_SCORES_BYTES", scores_bytes)
    g = torch.Generator().manual_seed(3)
    cu = [0, 1, 6, 6, 20, 23]  # includes a 1-token and an empty sequence
    q = torch.randn(23, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(23, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(23, 2, 8, generator=g, requires_grad=True)
    gate = torch.randn(23, 4, 8, generator=g)
    scale = 1 / math.sqrt(8)
    out = attn_autograd._plain_varlen(q, k, v, cu, scale, None)
    ref = _per_sequence(q, k, v, cu, scale)
    assert out.shape == (23, 4, 8)
    assert float((out.double() - ref).abs().max()) < 1e-5
    gated = attn_autograd._plain_varlen(q, k, v, cu, scale, gate)
    assert torch.equal(gated, out * torch.sigmoid(gate))

    def grads():
        q.grad = k.grad = v.grad = None
        (attn_autograd._plain_varlen(q, k, v, cu, scale, None) * gate).sum().backward()
        return [t.grad.clone() for t in (q, k, v)]

    first, second = grads(), grads()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    q.grad = k.grad = v.grad = None
    (_per_sequence(q, k, v, cu, scale) * gate.double()).sum().backward()
    for got, t in zip(first, (q, k, v), strict=True):
        assert float((got.double() - t.grad.double()).abs().max()) < 1e-4
