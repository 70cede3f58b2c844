"""Seeded random inputs of the gated delta rule for tests: the one recipe the CPU, interpreter and GPU
tests share, so their cases draw the same numbers; and the backward's bitwise claims checked in one place
(:func:`checked_rule_grads`), for the interpreter check and the GPU test alike."""

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


def checked_rule_grads(rule, x: tuple[torch.Tensor, ...], cu: torch.Tensor, w: torch.Tensor, **kw) -> list:
    """Gradients of ``(rule(*x, cu, **kw) * w).sum()`` for q, k, v, g, beta, once the backward's own claims hold bit
    for bit: the forward under autograd equals the plain forward, a second backward gives the same gradients, and
    so does one that recomputes the state pass (``keep_states=False``) instead of keeping it. The interpreter check
    and the GPU test hold these gradients to an fp64 reference at their own tolerances."""
    from megatron_iso.testing.bits import same_bits

    def grads(**extra) -> list:
        leaves = [t.clone().requires_grad_(True) for t in x]
        y = rule(*leaves, cu, **kw, **extra)
        assert same_bits(y.detach(), rule(*x, cu, **kw, **extra)), f"{kw}: forward bits under autograd"
        (y * w).sum().backward()
        return [t.grad for t in leaves]

    first, second = grads(), grads()
    assert all(same_bits(a, b) for a, b in zip(first, second, strict=True)), f"{kw}: backward not deterministic"
    kept = grads(keep_states=False)
    assert all(same_bits(a, b) for a, b in zip(first, kept, strict=True)), f"{kw}: keep_states changed the grads"
    return first
