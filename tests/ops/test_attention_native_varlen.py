"""Native (stock) training attention: one padded, masked SDPA call for packed sequences of similar length."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from megatron_iso.ops.attention import native


def _inputs(total: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(total)
    return [torch.randn(total, h, 16, generator=g).to(dtype).requires_grad_(True) for h in (4, 2, 2)]


def _count_sdpa(monkeypatch) -> list[int]:
    calls = [0]
    real = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(native.F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_batched_varlen_is_per_sequence_attention_in_one_call(monkeypatch, dtype, tol):
    q, k, v = _inputs(30, dtype)
    bounds = [0, 8, 15, 23, 30]
    calls = _count_sdpa(monkeypatch)
    out = native.attention_varlen(q, k, v, torch.tensor(bounds))
    assert calls[0] == 1
    ref = torch.cat([native._sdpa(q[a:b], k[a:b], v[a:b], 0, None) for a, b in itertools.pairwise(bounds)])
    assert float((out.float() - ref.float()).abs().max()) <= tol
    out.float().sum().backward()
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def test_uneven_lengths_fall_back_to_one_call_per_sequence(monkeypatch):
    q, k, v = _inputs(40, torch.float32)
    calls = _count_sdpa(monkeypatch)
    native.attention_varlen(q, k, v, torch.tensor([0, 1, 2, 40]))  # padding to 38 would triple the work
    assert calls[0] == 3
