"""The GDN causal conv's Triton backward (ops.gdn.triton.conv_gates.conv_backward) under TRITON_INTERPRET=1: the
gradients of the plain torch form (its reference, differentiated by autograd) for packed sequences shorter and longer
than the kernel and the row block, in fp32 and bf16; a second call gives the same bits (deterministic); and the
layer's autograd routes through it."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_iso.ops.gdn.triton import conv_gates

    torch.manual_seed(0)
    cu = torch.tensor([0, 2, 3, 70, 75])  # sequences of 2, 1, 67 (crosses the 64-row block) and 5 rows
    T, C, K = 75, 136, 4  # C crosses the 128-channel block
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(T, C).to(dtype).requires_grad_(True)
        w = (torch.randn(C, K) / 2).to(dtype).requires_grad_(True)
        dy = torch.randn(T, C).to(dtype)
        ref = conv_gates._conv_plain(x, w, cu)
        gx_ref, gw_ref = torch.autograd.grad(ref, (x, w), dy)
        gx, gw = conv_gates.conv_backward(dy, x.detach(), w.detach(), cu)
        assert gx.dtype == dtype and gw.dtype == dtype
        scale_x, scale_w = float(gx_ref.float().abs().max()), float(gw_ref.float().abs().max())
        assert float((gx.float() - gx_ref.float()).abs().max()) <= tol * scale_x, dtype
        assert float((gw.float() - gw_ref.float()).abs().max()) <= tol * scale_w, dtype
        gx2, gw2 = conv_gates.conv_backward(dy, x.detach(), w.detach(), cu)
        view = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(gx.view(view), gx2.view(view)) and torch.equal(gw.view(view), gw2.view(view))
        # the op's autograd: the kernel forward, this backward
        y = conv_gates.causal_conv1d(x, w, cu)
        ax, aw = torch.autograd.grad(y, (x, w), dy)
        assert torch.equal(ax.view(view), gx.view(view)) and torch.equal(aw.view(view), gw.view(view))
    print("ok")
    """
)


def test_conv_backward_matches_the_plain_form_under_interpreter():
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
