"""The GDN causal conv's Triton backward on the GPU: the gradients of the plain torch form (autograd of its fp32
formula) at a Qwen3.5 GDN layer's width over packed sequences, and the same bits on a second call."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


def test_conv_backward_matches_the_plain_form():
    from megatron_iso.ops.gdn.triton import conv_gates

    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 3, 700, 701, 2048], device="cuda")
    t, c, k = 2048, 8192, 4
    x = torch.randn(t, c, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(c, k, device="cuda", generator=gen) / 2).bfloat16().requires_grad_(True)
    dy = torch.randn(t, c, device="cuda", generator=gen).bfloat16()
    gx_ref, gw_ref = torch.autograd.grad(conv_gates._conv_plain(x, w, cu), (x, w), dy)
    gx, gw = conv_gates.conv_backward(dy, x.detach(), w.detach(), cu)
    assert float((gx.float() - gx_ref.float()).abs().max()) <= 2e-2 * float(gx_ref.float().abs().max())
    assert float((gw.float() - gw_ref.float()).abs().max()) <= 2e-2 * float(gw_ref.float().abs().max())
    gx2, gw2 = conv_gates.conv_backward(dy, x.detach(), w.detach(), cu)
    assert torch.equal(bits(gx), bits(gx2)) and torch.equal(bits(gw), bits(gw2))
