"""The GPU backward kernels of the row norms (``ops.norm.norm_backward_triton``: RMSNorm plain / zero-centred /
gated, GDN's l2norm) and of SwiGLU (``ops.activation.activation_triton``) under TRITON_INTERPRET=1: the gradients of
the native formulas' autograd (the CPU path's backward) within fp32 / bf16 rounding, for row counts that do and do
not fill a program's row block; a second call gives the same bits; and ``with_fused_backward`` routes autograd
through them."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import functools
    import torch
    from megatron_iso.ops.activation import activation_triton, native as act_native
    from megatron_iso.ops.common.autograd import with_fused_backward
    from megatron_iso.ops.gdn import native as gdn_native
    from megatron_iso.ops.norm import native, norm_backward_triton as nb

    torch.manual_seed(0)

    def close(got, ref, tol, what):
        scale = max(float(ref.float().abs().max()), 1e-30)
        err = float((got.float() - ref.float()).abs().max())
        assert got.dtype == ref.dtype, (what, got.dtype, ref.dtype)
        assert err <= tol * scale, (what, err, scale)

    def same_bits(a, b):
        view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))

    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        # rows 37 (not a multiple of the row block) of hidden 96 (not a power of two); rows 300 of 64 (several programs)
        for rows, h in ((37, 96), (300, 64)):
            x = torch.randn(rows, h).to(dtype).requires_grad_(True)
            z = torch.randn(rows, h).to(dtype).requires_grad_(True)
            w = (torch.randn(h) * 0.2).to(dtype).requires_grad_(True)
            dy = torch.randn(rows, h).to(dtype)
            for zc in (False, True):
                ref = torch.autograd.grad(native.rms_norm(x, w, 1e-6, zero_centered=zc), (x, w), dy)
                got = nb.rms_norm_backward(dy, x.detach(), w.detach(), eps=1e-6, zero_centered=zc)
                for g, r, n in zip(got, ref, ("dx", "dw")):
                    close(g, r, tol, ("rms", dtype, rows, zc, n))
                again = nb.rms_norm_backward(dy, x.detach(), w.detach(), eps=1e-6, zero_centered=zc)
                assert all(same_bits(a, b) for a, b in zip(got, again))
                ref = torch.autograd.grad(native.gated_rms_norm(x, z, w, 1e-6, zero_centered=zc), (x, z, w), dy)
                got = nb.gated_rms_norm_backward(dy, x.detach(), z.detach(), w.detach(), eps=1e-6, zero_centered=zc)
                for g, r, n in zip(got, ref, ("dx", "dgate", "dw")):
                    close(g, r, tol, ("gated", dtype, rows, zc, n))
                # autograd through with_fused_backward: the kernel's bits, the invariant forward's output
                fwd = functools.partial(native.gated_rms_norm, eps=1e-6, zero_centered=zc)
                bwd = functools.partial(nb.gated_rms_norm_backward, eps=1e-6, zero_centered=zc)
                y = with_fused_backward(fwd, bwd, x, z, w)
                assert y.grad_fn is not None and not y.grad_fn.name().startswith("Mul")
                auto = torch.autograd.grad(y, (x, z, w), dy)
                assert all(same_bits(a, b) for a, b in zip(auto, got))
            # l2norm: fp32 output, dx in x's dtype
            dyf = torch.randn(rows, h)
            (ref,) = torch.autograd.grad(gdn_native.l2norm(x, 1e-6), (x,), dyf)
            dx, none = nb.l2norm_backward(dyf, x.detach(), 1e-6)
            assert none is None
            close(dx, ref, tol, ("l2norm", dtype, rows))
        # SwiGLU, separate halves and the packed [gate | up] layout
        xp = (torch.randn(45, 2 * 80) * 3).to(dtype).requires_grad_(True)
        gate, up = torch.chunk(xp, 2, dim=-1)
        dy = torch.randn(45, 80).to(dtype)
        ref = torch.autograd.grad(act_native.swiglu(gate, up), (gate, up), dy)
        got = activation_triton.swiglu_backward(dy, gate.detach(), up.detach())
        for g, r, n in zip(got, ref, ("dgate", "dup")):
            close(g, r, tol, ("swiglu", dtype, n))
        (ref_packed,) = torch.autograd.grad(act_native.swiglu(gate, up), (xp,), dy)
        (packed,) = activation_triton.swiglu_packed_backward(dy, xp.detach())
        close(packed, ref_packed, tol, ("swiglu packed", dtype))
        assert same_bits(packed, torch.cat(got, dim=-1))
    print("ok")
    """
)


def test_norm_and_swiglu_backward_kernels_match_autograd_of_the_native_forms():
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
