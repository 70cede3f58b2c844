"""The one-launch MoE router (``ops.moe.route_triton``) under TRITON_INTERPRET=1: scores, weights, experts,
routing map and probs bit for bit those of the torch reference and the layer's scatters, with ties, row counts that
do not fill a program, k = 1, plain and renormalised weights; ``ops.moe.route`` takes it only without autograd."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_iso.ops import moe
    from megatron_iso.ops.moe import reference, route_triton

    def bits(t):
        return t.view(torch.int32) if t.dtype == torch.float32 else t

    g = torch.Generator().manual_seed(7)
    cases = [(37, 16, 4), (5, 128, 8), (3, 512, 8), (9, 32, 1), (1, 8, 8), (0, 16, 2)]
    checked = 0
    for n, e, k in cases:
        logits = torch.randn(n, e, generator=g) * 4
        if n >= 3:
            logits[0, [3, 9, e - 1]] = logits[0].max() + 1.0  # a three-way tie at the top
            logits[1] = 0.25  # every expert equal: experts 0 .. k-1
            logits[2, : e // 2] = -30.0  # tiny probabilities next to large ones
        for normalize in (True, False):
            got = route_triton.route_triton(logits, k, normalize=normalize)
            scores = reference.router_probs(logits)
            w, ex = reference.top_k_route(scores, k, normalize=normalize)
            want = moe.scattered_route(scores, w, ex)
            for name, a, b in zip(want._fields, got, want):
                assert a.dtype == b.dtype and a.shape == b.shape, (n, e, k, name, a.dtype, b.dtype, a.shape)
                assert torch.equal(bits(a), bits(b)), (n, e, k, normalize, name)
            checked += 1
            if n >= 3:
                assert got[2][1].tolist() == list(range(k))
                top = sorted([3, 9, e - 1])[: min(k, 3)]
                assert got[2][0].tolist()[: len(top)] == top or k > 3, (got[2][0], top)

    # The dispatch point: the kernel without autograd, the torch composition with it (its autograd is the backward).
    calls = []
    real = route_triton.route_triton
    route_triton.route_triton = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    logits = torch.randn(6, 16, generator=g)
    with torch.no_grad():
        fast = moe.route(logits, 4, normalize=True)
    assert calls == [1]
    leaf = logits.clone().requires_grad_(True)
    slow = moe.route(leaf, 4, normalize=True)
    assert calls == [1] and slow.probs.grad_fn is not None
    for a, b in zip(fast, slow):
        assert torch.equal(bits(a.detach()), bits(b.detach()))
    assert not route_triton.serves(torch.randn(4, 24), 4)  # E not a power of two: the reference
    assert not route_triton.serves(torch.randn(4, 16), 3)  # k not a power of two
    print("ok", checked)
    """
)


def test_route_kernel_has_the_reference_bits():
    proc = run_interpreted(SCRIPT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["ok", "12"], proc.stdout
