"""with_plain_backward: forward bits of the invariant kernel, gradient of the plain formula."""

import functools

import torch

from megatron_iso.ops.activation import native as act_native
from megatron_iso.ops.activation import swiglu
from megatron_iso.ops.norm import native as norm_native
from megatron_iso.ops.norm import rms_norm
from megatron_iso.testing.bits import bits


def test_forward_bits_are_the_invariant_kernels_and_grads_the_plain_formulas():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(48, generator=g)).requires_grad_(True)
    out = rms_norm(x, w, 1e-6)
    with torch.no_grad():
        assert torch.equal(bits(out), bits(rms_norm(x, w, 1e-6)))
    c = torch.randn(5, 48, generator=g)  # fixed upstream gradient (not a function of out's bits)
    (out * c).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (functools.partial(norm_native.rms_norm, eps=1e-6)(x2, w2) * c).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_backward_is_deterministic_and_matches_native_swiglu():
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(7, 32, generator=g).requires_grad_(True) for _ in range(2))
    grads = []
    for _ in range(2):
        a.grad = b.grad = None
        swiglu(a, b).sum().backward()
        grads.append((a.grad.clone(), b.grad.clone()))
    assert all(torch.equal(x, y) for x, y in zip(grads[0], grads[1], strict=True))
    a2, b2 = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    act_native.swiglu(a2, b2).sum().backward()
    assert torch.equal(grads[0][0], a2.grad) and torch.equal(grads[0][1], b2.grad)
