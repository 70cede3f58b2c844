"""Decode-step host work on a CUDA device: with the step's KVStepPlan the kv-cache attention of both
profiles runs without a host sync (torch.cuda sync debug mode set to error), the Triton path gives
the bits it gives without a plan, and the native profile's one batched SDPA call per step stays
close to the per-sequence SDPA path it replaced."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

HQ, HKV, D, N, MAX_LEN = 16, 8, 128, 64, 640  # Qwen3-0.6B attention shapes, 64 sequences


def _step(decode: bool, seed: int = 0):
    from megatron_iso.ops.attention import KVStepPlan

    g = torch.Generator().manual_seed(seed)
    lengths = [1] * N if decode else torch.randint(100, 129, (N,), generator=g).tolist()
    starts = torch.randint(0, 500, (N,), generator=g).tolist() if decode else [0] * N
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    t = cu[-1]
    q, k, v = (torch.randn(t, h, D, generator=g).to(torch.bfloat16).cuda() for h in (HQ, HKV, HKV))
    cache = torch.randn(N, MAX_LEN, HKV, D, generator=g).to(torch.bfloat16).cuda()
    layout = [torch.tensor(x, device="cuda") for x in (starts, cu, list(range(N)))]
    return q, k, v, cache, layout, KVStepPlan(cu, starts, list(range(N)))


def _call(profile, q, k, v, cache, layout, plan):
    from megatron_iso.ops.attention import attention_with_kv_cache

    kc, vc = cache.clone(), cache.flip(1).clone()
    starts, cu, slots = layout
    o = attention_with_kv_cache(q, k, v, kc, vc, starts, cu, slots=slots, profile=profile, plan=plan)
    return o, kc, vc


@pytest.mark.parametrize("profile", ["correctness", "performance"])
@pytest.mark.parametrize("decode", [True, False])
def test_no_host_sync_with_plan(profile: str, decode: bool) -> None:
    q, k, v, cache, layout, plan = _step(decode)
    _call(profile, q, k, v, cache, layout, plan)  # first layer: builds the step's index tensors
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _layer in range(3):  # the step's other layers
            _call(profile, q, k, v, cache, layout, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("decode", [True, False])
def test_triton_plan_same_bits(decode: bool) -> None:
    q, k, v, cache, layout, plan = _step(decode, seed=1)
    without = _call("correctness", q, k, v, cache, layout, None)
    with_plan = _call("correctness", q, k, v, cache, layout, plan)
    again = _call("correctness", q, k, v, cache, layout, plan)  # tables from the plan's memo
    for got in (with_plan, again):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, without, strict=True))


@pytest.mark.parametrize("decode", [True, False])
def test_native_batched_close_to_per_sequence(decode: bool) -> None:
    from megatron_iso.ops.attention import native

    q, k, v, cache, layout, plan = _step(decode, seed=2)
    batched = _call("performance", q, k, v, cache, layout, plan)
    kc, vc = cache.clone(), cache.flip(1).clone()
    ref = torch.empty_like(q)
    for i, (a, b) in enumerate(zip(plan.cu, plan.cu[1:], strict=False)):
        s = plan.starts[i]
        kc[i, s : s + b - a], vc[i, s : s + b - a] = k[a:b], v[a:b]
        ref[a:b] = native._sdpa(q[a:b], kc[i, : s + b - a], vc[i, : s + b - a], s, None)
    assert torch.equal(batched[1], kc) and torch.equal(batched[2], vc)
    err = (batched[0].float() - ref.float()).abs().max().item()
    print(f"native batched vs per-sequence SDPA, {'decode' if decode else 'prefill'}: max |d| {err:.3g}")
    assert err < 2e-2
