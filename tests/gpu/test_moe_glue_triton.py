"""The MoE layer's one-launch kernels on the GPU at the models' widths, bit for bit the torch path on the same device
(which the CPU tests hold to the CPU's bits): the router (scores, weights, experts, routing map, probs), the slots'
expert-major order and the combine with the shared expert, for decode-sized and larger row counts."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


@pytest.mark.parametrize("e,k", [(32, 4), (128, 8), (512, 8), (64, 1)])
@pytest.mark.parametrize("rows", [1, 33, 4096])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_kernel_has_the_reference_bits(e, k, rows, normalize):
    from megatron_iso.ops import moe
    from megatron_iso.ops.moe import reference, route_triton

    gen = torch.Generator(device="cuda").manual_seed(rows * e + k)
    logits = torch.randn(rows, e, device="cuda", generator=gen) * 3
    logits[0, [1, e // 2, e - 1]] = logits[0].max() + 0.5  # a tie at the top
    got = route_triton.route_triton(logits, k, normalize=normalize)
    scores = reference.router_probs(logits)
    want = moe.scattered_route(scores, *reference.top_k_route(scores, k, normalize=normalize))
    for name, a, b in zip(want._fields, got, want, strict=True):
        assert same_bits(a, b), name
    # and the CPU reference's bits (the trainer on another device class routes alike)
    cpu_scores = reference.router_probs(logits.cpu())
    cpu_weights, cpu_experts = reference.top_k_route(cpu_scores, k, normalize=normalize)
    assert same_bits(got[0].cpu(), cpu_scores) and same_bits(got[1].cpu(), cpu_weights)
    assert torch.equal(got[2].cpu(), cpu_experts)


@pytest.mark.parametrize("e,k,h", [(32, 4, 1024), (128, 8, 2048), (512, 8, 1024)])
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_slot_order_and_combine_have_the_torch_bits(e, k, h, tokens):
    from megatron_iso.ops import moe
    from megatron_iso.ops.moe import slots_triton

    gen = torch.Generator(device="cuda").manual_seed(tokens * e + k)
    experts = torch.rand(tokens, e, device="cuda", generator=gen).topk(k, dim=1).indices.sort(dim=1).values
    flat = experts.reshape(-1)
    order, inverse = slots_triton.slot_order_triton(flat)
    assert torch.equal(order, torch.sort(flat, stable=True).indices)
    assert torch.equal(inverse[order], torch.arange(flat.numel(), device="cuda"))
    y = torch.randn(flat.numel(), h, device="cuda", generator=gen)
    w = torch.rand(tokens, k, device="cuda", generator=gen)
    shared = torch.randn(tokens, h, device="cuda", generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        got = slots_triton.combine_triton(y, inverse, w, shared, dtype)
        want = (moe.combine_routed(y[inverse].reshape(tokens, k, h), w) + shared).to(dtype)
        assert same_bits(got, want), dtype


@pytest.mark.parametrize("e,k,h,tokens", [(32, 4, 1024, 16384), (128, 8, 2048, 6144)])
def test_combine_backward_matches_autograd_at_trainer_sizes(e, k, h, tokens):
    from megatron_iso.ops import moe

    gen = torch.Generator(device="cuda").manual_seed(tokens + k)
    experts = torch.rand(tokens, e, device="cuda", generator=gen).topk(k, dim=1).indices.sort(dim=1).values
    _, inverse = moe.slot_order(experts.reshape(-1))
    y = torch.randn(tokens * k, h, device="cuda", generator=gen).requires_grad_(True)
    w = torch.rand(tokens, k, device="cuda", generator=gen).requires_grad_(True)
    shared = torch.randn(tokens, h, device="cuda", generator=gen).requires_grad_(True)
    dout = torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()
    ref_out = (moe.combine_routed(y[inverse].reshape(tokens, k, h), w) + shared).bfloat16()
    ref = torch.autograd.grad(ref_out, (y, w, shared), dout)
    out = moe.combine_slots(y, inverse, w, shared, torch.bfloat16)
    assert same_bits(out.detach(), ref_out.detach())
    got = torch.autograd.grad(out, (y, w, shared), dout)
    again = torch.autograd.grad(moe.combine_slots(y, inverse, w, shared, torch.bfloat16), (y, w, shared), dout)
    assert same_bits(got[0], ref[0]) and same_bits(got[2], ref[2])
    assert float((got[1] - ref[1]).abs().max()) <= 1e-5 * float(ref[1].abs().max())
    assert all(same_bits(a, b) for a, b in zip(got, again, strict=True))
