"""Seeded random inputs of the gated delta rule for tests: the one recipe the CPU, interpreter and GPU
tests share, so their cases draw the same numbers."""

from __future__ import annotations

import torch


def random_gdn_inputs(
    n: int, seed: int, *, hk: int, hv: int, dk: int, dv: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, g, beta)`` for ``n`` packed tokens: l2-normalised q/k ``[n, hk, dk]``, v ``[n, hv, dv]``,
    gates from random ``a, b`` and per-head ``A_log`` in (-inf, log 2); drawn on the CPU, then moved."""
    from megatron_iso.ops.gdn.reference import gdn_gates, l2norm

    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, hk, dk, generator=gen))
    k = l2norm(torch.randn(n, hk, dk, generator=gen))
    v = torch.randn(n, hv, dv, generator=gen)
    a, b = torch.randn(n, hv, generator=gen) * 2, torch.randn(n, hv, generator=gen)
    g, beta = gdn_gates(a, b, torch.rand(hv, generator=gen).mul(2).log(), torch.ones(hv))
    return tuple(t.to(device) for t in (q, k, v, g, beta))
