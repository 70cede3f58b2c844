"""The row-norm and SwiGLU backward kernels on the GPU, at the trainer's widths: the gradients of the native
formulas' autograd (fp32 reference), the same bits on a second call, and the public ops' autograd routed through
them in the correctness profile (the performance profile keeps torch's autograd)."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert got.dtype == ref.dtype
    assert float((got.float() - ref.float()).abs().max()) <= tol * float(ref.float().abs().max())


@pytest.mark.parametrize("rows,h,gated", [(8192, 1024, False), (4096, 4096, False), (65536, 128, True)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_row_norm_backward_matches_autograd_of_the_native_form(rows, h, gated, zero_centered):
    from megatron_iso.ops.norm import native
    from megatron_iso.ops.norm import norm_backward_triton as nb

    gen = torch.Generator(device="cuda").manual_seed(rows + h)
    x = torch.randn(rows, h, device="cuda", generator=gen).bfloat16()
    z = torch.randn(rows, h, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(h, device="cuda", generator=gen) * 0.2).bfloat16()
    dy = torch.randn(rows, h, device="cuda", generator=gen).bfloat16()
    # reference: autograd of the native formula in fp32 (the bf16 autograd rounds at every node)
    xf, zf, wf = (t.float().requires_grad_(True) for t in (x, z, w))
    if gated:
        y = native.gated_rms_norm(xf, zf, wf, 1e-6, zero_centered=zero_centered)
        ref = torch.autograd.grad(y, (xf, zf, wf), dy.float())
        got = nb.gated_rms_norm_backward(dy, x, z, w, eps=1e-6, zero_centered=zero_centered)
        again = nb.gated_rms_norm_backward(dy, x, z, w, eps=1e-6, zero_centered=zero_centered)
    else:
        y = native.rms_norm(xf, wf, 1e-6, zero_centered=zero_centered)
        ref = torch.autograd.grad(y, (xf, wf), dy.float())
        got = nb.rms_norm_backward(dy, x, w, eps=1e-6, zero_centered=zero_centered)
        again = nb.rms_norm_backward(dy, x, w, eps=1e-6, zero_centered=zero_centered)
    for g, r, a in zip(got, ref, again, strict=True):
        _close(g, r.bfloat16(), 1e-2)
        assert torch.equal(bits(g), bits(a))


def test_swiglu_backward_matches_autograd_and_the_public_op_routes_through_it():
    from megatron_iso.ops.activation import activation_triton, swiglu_packed
    from megatron_iso.registry import Profile

    gen = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(16384, 2 * 1536, device="cuda", generator=gen) * 3).bfloat16()
    dy = torch.randn(16384, 1536, device="cuda", generator=gen).bfloat16()
    xf = x.float().requires_grad_(True)
    g, u = torch.chunk(xf, 2, dim=-1)
    (ref,) = torch.autograd.grad(torch.nn.functional.silu(g) * u, (xf,), dy.float())
    (got,) = activation_triton.swiglu_packed_backward(dy, x)
    _close(got, ref.bfloat16(), 1e-2)
    xr = x.clone().requires_grad_(True)
    y = swiglu_packed(xr, profile=Profile.CORRECTNESS)
    (auto,) = torch.autograd.grad(y, (xr,), dy)
    assert torch.equal(bits(auto), bits(got))
    (auto2,) = torch.autograd.grad(swiglu_packed(xr, profile=Profile.CORRECTNESS), (xr,), dy)
    assert torch.equal(bits(auto2), bits(got))


def test_public_norm_ops_route_through_the_kernels_in_the_correctness_profile():
    from megatron_iso.ops.gdn import l2norm
    from megatron_iso.ops.norm import gated_rms_norm, norm_backward_triton, rms_norm
    from megatron_iso.registry import Profile

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2048, 1024, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    z = torch.randn(2048, 1024, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(1024, device="cuda", generator=gen) * 0.1).bfloat16().requires_grad_(True)
    dy = torch.randn(2048, 1024, device="cuda", generator=gen).bfloat16()
    y = rms_norm(x, w, 1e-6, zero_centered=True, profile=Profile.CORRECTNESS)
    auto = torch.autograd.grad(y, (x, w), dy)
    kern = norm_backward_triton.rms_norm_backward(dy, x.detach(), w.detach(), eps=1e-6, zero_centered=True)
    assert all(torch.equal(bits(a), bits(k)) for a, k in zip(auto, kern, strict=True))
    y = gated_rms_norm(x, z, w, 1e-6, profile=Profile.CORRECTNESS)
    auto = torch.autograd.grad(y, (x, z, w), dy)
    kern = norm_backward_triton.gated_rms_norm_backward(dy, x.detach(), z.detach(), w.detach(), eps=1e-6,
                                                        zero_centered=False)  # fmt: skip
    assert all(torch.equal(bits(a), bits(k)) for a, k in zip(auto, kern, strict=True))
    q = x.reshape(2048, 8, 128)
    yq = l2norm(q, profile=Profile.CORRECTNESS)
    dyq = torch.randn(2048, 8, 128, device="cuda", generator=gen)
    (auto,) = torch.autograd.grad(yq, (x,), dyq)
    kern, _ = norm_backward_triton.l2norm_backward(dyq, q.detach(), 1e-6)
    assert torch.equal(bits(auto), bits(kern.reshape(2048, 1024)))
