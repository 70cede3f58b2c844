"""The MoE dispatcher's one-launch slot order and combine (``ops.moe.slots_triton``) under TRITON_INTERPRET=1: the
stable sort's permutation and its inverse exactly, and the layer's output (routed tree sum over k plus the shared
expert, rounded once) bit for bit the torch path's, for k = 1 .. 8, with and without a shared expert, bf16 and fp32
outputs, widths that do not fill a block; the combine's one-pass backward against autograd of the torch path."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_iso.ops import moe
    from megatron_iso.ops.moe import slots_triton
    from megatron_iso.testing.bits import same_bits
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()
    g = torch.Generator().manual_seed(3)
    for s, e in ((1, 4), (37, 8), (300, 64), (256, 2)):  # one slot; a partial block; several programs; ties
        flat = torch.randint(0, e, (s,), generator=g)
        order, inverse = slots_triton.slot_order_triton(flat)
        want = torch.sort(flat, stable=True).indices
        assert torch.equal(order, want), (s, e)
        assert torch.equal(inverse[order], torch.arange(s)), (s, e)
        for topk in (1, 2, 4):  # the sources: the token each expert-major row copies, from the same launch
            o2, i2, source = slots_triton.slot_order_triton(flat, topk)
            assert torch.equal(o2, order) and torch.equal(i2, inverse) and torch.equal(source, want // topk), topk
            assert all(torch.equal(a, b) for a, b in zip(moe.slot_order_with_sources(flat, topk), (o2, i2, source)))

    checked = 0
    for n, k, h in ((5, 4, 300), (3, 1, 64), (4, 8, 33), (2, 2, 512)):
        experts = torch.stack([torch.randperm(16, generator=g)[:k].sort().values for _ in range(n)])
        order, inverse = moe.slot_order(experts.reshape(-1))
        y = torch.randn(n * k, h, generator=g) * 3  # expert-major rows, fp32
        w = torch.rand(n, k, generator=g)
        for shared in (None, torch.randn(n, h, generator=g), torch.randn(n, h, generator=g).bfloat16()):
            for dtype in (torch.bfloat16, torch.float32):
                got = slots_triton.combine_triton(y, inverse, w, shared, dtype)
                per_slot = y[inverse].reshape(n, k, h)
                ref = moe.combine_routed(per_slot, w)
                if shared is not None:
                    ref = ref + shared.float()
                assert same_bits(got, ref.to(dtype)), (n, k, h, None if shared is None else shared.dtype, dtype)
                checked += 1

    # The backward: dy is the torch product's bits at each slot's row, dw within fp32 rounding of autograd's sum
    # (another order), the same bits on a second call; d shared is the output gradient widened.
    for n, k, h in ((5, 4, 300), (3, 1, 64), (4, 8, 33)):
        experts = torch.stack([torch.randperm(16, generator=g)[:k].sort().values for _ in range(n)])
        order, inverse = moe.slot_order(experts.reshape(-1))
        y = (torch.randn(n * k, h, generator=g) * 3).requires_grad_(True)
        w = torch.rand(n, k, generator=g).requires_grad_(True)
        shared = torch.randn(n, h, generator=g).requires_grad_(True)
        dout = torch.randn(n, h, generator=g).bfloat16()
        ref_out = (moe.combine_routed(y[inverse].reshape(n, k, h), w) + shared).bfloat16()
        ref = torch.autograd.grad(ref_out, (y, w, shared), dout)
        got = slots_triton.combine_backward_triton(dout, y.detach(), inverse, w.detach(), shared.detach(), torch.bfloat16)
        again = slots_triton.combine_backward_triton(dout, y.detach(), inverse, w.detach(), shared.detach(), torch.bfloat16)
        assert got[1] is None and got[4] is None
        assert same_bits(got[0], ref[0]) and same_bits(got[3], ref[2]), (n, k, h)
        scale = float(ref[1].abs().max())
        assert float((got[2] - ref[1]).abs().max()) <= 1e-6 * scale * h ** 0.5, (n, k, h)
        assert all(same_bits(a, b) for a, b in zip(got[:4:3], again[:4:3])) and same_bits(got[2], again[2])
        # autograd through ops.moe.combine_slots: the kernels' gradients, the forward's bits
        out = moe.combine_slots(y, inverse, w, shared, torch.bfloat16)
        assert out.grad_fn is not None and same_bits(out.detach(), ref_out.detach())
        auto = torch.autograd.grad(out, (y, w, shared), dout)
        assert same_bits(auto[0], got[0]) and same_bits(auto[1], got[2]) and same_bits(auto[2], got[3])
        checked += 1

    # The dispatch points: the kernels on the device (the interpreter), with or without autograd.
    calls = []
    for name in ("slot_order_triton", "combine_triton"):
        real = getattr(slots_triton, name)
        setattr(slots_triton, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    flat = torch.tensor([3, 1, 3, 0, 1, 1])
    order, inverse = moe.slot_order(flat)
    y, w = torch.randn(6, 40, generator=g), torch.rand(3, 2, generator=g)
    fast = moe.combine_slots(y, inverse, w, None, torch.bfloat16)
    slow = moe.combine_slots(y.requires_grad_(True), inverse, w, None, torch.bfloat16)
    assert calls == ["slot_order_triton", "combine_triton", "combine_triton"], calls
    assert slow.grad_fn is not None and same_bits(fast, slow.detach())
    assert not slots_triton.serves_combine(torch.randn(6, 8), torch.rand(2, 3), None, torch.float32)  # k = 3
    print("ok", checked)
    """
)


def test_slot_kernels_have_the_torch_bits():
    proc = run_interpreted(SCRIPT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["ok", "27"], proc.stdout
