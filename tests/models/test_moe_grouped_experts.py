"""IsoSequentialExperts' grouped path (two grouped GEMMs, the CUDA path) computes what the per-expert
loop computes, bit for bit, forward and backward. Here it runs on CPU through the grouped op's torch
reference; tests/gpu/test_grouped_gemm.py runs the same comparison with the Triton kernel."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

COUNTS = [5, 0, 1, 9, 3, 0, 2, 4]  # tiny_moe has 8 experts: empty experts and a one-row expert


def _loop_vs_grouped(dtype: str, overrides: tuple[str, ...] = ()):
    """Forward and backward of the first layer's experts, per-expert loop vs grouped path, on the
    device the model was built on (build_model moves it to CUDA when there is one). On CPU the
    grouped path is called directly (the CPU forward keeps the loop); on CUDA through forward."""
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    tc = transformer_config(load_config(["model=tiny_moe", f"model.params_dtype={dtype}", *overrides]))
    model = build_model(tc, random_hf_state_dict(tc, seed=7, std=0.2)).train()
    experts = model.decoder.layers[0].mlp.experts
    device = experts.local_experts[0].linear_fc1.weight.device
    counts = torch.tensor(COUNTS, device=device)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(sum(COUNTS), tc.hidden_size, generator=g).to(device, tc.params_dtype)
    probe = torch.randn(sum(COUNTS), tc.hidden_size, generator=g).to(device)
    params = [p for e in experts.local_experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
    results = []
    for run in ("loop", "grouped"):
        experts.grouped_on_cuda = run == "grouped"
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_(True)
        direct = run == "grouped" and device.type == "cpu"
        out = experts._grouped_fp32(x, counts) if direct else experts(x, counts)[0]
        (out * probe).sum().backward()
        results.append((out.detach().cpu(), x.grad.cpu(), [p.grad.cpu() for p in params]))
    return results, experts._can_group(x0)


def _loop_vs_grouped_cuda(dtype: str):
    """The same on a GPU in a one-process Megatron world (tests/gpu/test_grouped_gemm.py). The expert
    width is raised to 512 so that fc2's leaf depth (512 / 8 leaves) is a whole number of Triton K-tiles
    (tiny_moe's 32 / 8 is not: the dense kernel refuses it, loop or grouped)."""
    from megatron_iso.parallel.world import single_process_world

    with single_process_world():
        return _loop_vs_grouped(dtype, ("model.moe_ffn_hidden_size=512",))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grouped_experts_equal_the_per_expert_loop(dtype):
    (loop, grouped), can_group_on_cpu = run_on_ranks(_loop_vs_grouped, 1, args=(dtype,))[0]
    assert not can_group_on_cpu  # the CPU forward keeps the per-expert reference loop
    assert loop[0].dtype == torch.float32 and loop[0].shape == grouped[0].shape
    assert torch.equal(bits(grouped[0]), bits(loop[0])), "forward"
    assert torch.equal(bits(grouped[1]), bits(loop[1])), "grad of the tokens"
    for i, (a, b) in enumerate(zip(grouped[2], loop[2], strict=True)):
        assert torch.equal(bits(a), bits(b)), f"weight grad {i}"
    assert bool(loop[0].abs().sum() > 0) and bool(loop[2][0].abs().sum() > 0)
