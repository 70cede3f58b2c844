"""The one-launch MoE router on the GPU at the models' router widths: scores, weights, experts, routing map and
probs bit for bit those of the torch reference composition on the same device (which the CPU tests hold to the
CPU's bits), for decode-sized and trainer-sized row counts; the router layer takes it under no_grad."""

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
