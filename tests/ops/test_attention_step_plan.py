"""KVStepPlan: the attention kv-cache implementations read a step's layout from host lists, not from
the device tensors (no host sync per layer on GPU), share index tensors across layers, and give the
same results as without a plan: bit for bit in the correctness profile, and for the native profile's
batched SDPA (one call per step) within SDPA's tolerance of the per-sequence path."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.attention import KVStepPlan, attention_with_kv_cache
from megatron_iso.ops.attention import native as native_attention
from megatron_iso.ops.attention import reference as reference_attention
from megatron_iso.testing.bits import bits

HQ, HKV, D, MAX_LEN = 8, 4, 16, 96


def _step(seed: int, lengths: list[int], starts: list[int], slots: list[int], dtype: torch.dtype, gated: bool):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v, gate = (torch.randn(t, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV, HQ))
    cache = torch.randn(max(slots) + 2, MAX_LEN, HKV, D, generator=g).to(dtype)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return q, k, v, gate if gated else None, cache, cu


CASES = [  # (lengths, starts, slots): decode, prefill chunks, mixed, permuted slots
    ([1] * 6, [0, 5, 17, 40, 63, 64], list(range(6))),
    ([7, 20, 13], [0, 0, 33], [0, 1, 2]),
    ([1, 30, 1, 2], [50, 0, 64, 9], [3, 0, 2, 1]),
    ([1, 1, 1], [70, 2, 31], [4, 0, 2]),
]


def _run(profile, q, k, v, gate, cache, cu, starts, slots, plan, *, meta_tensors=False):
    kc, vc = cache.clone(), cache.flip(0).clone()
    dev = "meta" if meta_tensors else "cpu"
    # On the meta device a read of the layout tensors (tolist, indexing with them) fails: the plan
    # is then the only source of the layout.
    cu_t, st_t, sl_t = (torch.tensor(x, device=dev) for x in (cu, starts, slots))
    o = attention_with_kv_cache(q, k, v, kc, vc, st_t, cu_t, slots=sl_t, gate=gate, profile=profile, plan=plan)
    return o, kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_plan_matches_tensors(dtype: torch.dtype, case: int) -> None:
    lengths, starts, slots = CASES[case]
    q, k, v, gate, cache, cu = _step(case, lengths, starts, slots, dtype, gated=case % 2 == 0)
    ref = _run("correctness", q, k, v, gate, cache, cu, starts, slots, None)
    with_plan = _run("correctness", q, k, v, gate, cache, cu, starts, slots, KVStepPlan(cu, starts, slots))
    on_meta = _run(
        "correctness", q, k, v, gate, cache, cu, starts, slots, KVStepPlan(cu, starts, slots), meta_tensors=True
    )
    for got in (with_plan, on_meta):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, ref, strict=True))
    native = _run("performance", q, k, v, gate, cache, cu, starts, slots, KVStepPlan(cu, starts, slots))
    native_meta = _run(
        "performance", q, k, v, gate, cache, cu, starts, slots, KVStepPlan(cu, starts, slots), meta_tensors=True
    )
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for got in (native, native_meta):
        assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])  # the cache writes are exact copies
        assert (got[0].float() - ref[0].float()).abs().max().item() < tol


def test_native_one_sdpa_call_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode and prefill steps of distinct slots run one SDPA call per layer whatever the number of
    sequences (unless padding would more than double the work), and the step's index tensors are
    built once for all layers."""
    calls, builds = [], []
    sdpa = native_attention.F.scaled_dot_product_attention
    monkeypatch.setattr(
        native_attention.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw)
    )
    index = native_attention._batched_index
    monkeypatch.setattr(native_attention, "_batched_index", lambda *a: builds.append(1) or index(*a))
    for lengths, starts, slots in CASES:
        q, k, v, gate, cache, cu = _step(0, lengths, starts, slots, torch.float32, gated=False)
        plan = KVStepPlan(cu, starts, slots)
        calls.clear(), builds.clear()
        for _layer in range(3):
            _run("performance", q, k, v, gate, cache, cu, starts, slots, plan)
        # padding to the longest chunk at most doubles the work: one call; else one per sequence
        batched = len(lengths) * max(lengths) <= 2 * sum(lengths)
        assert (len(calls), len(builds)) == (3 if batched else 3 * len(lengths), 1), lengths
        assert batched or lengths == [1, 30, 1, 2]


def test_native_falls_back_for_repeated_slots_and_sparse_padding() -> None:
    """A slot used twice in one call (each sequence reads the other's writes) and a step whose
    padding would more than double the work keep per-sequence SDPA calls; results stay close."""
    for lengths, starts, slots in (([3, 2], [0, 3], [1, 1]), ([60, 1, 1, 1], [0, 5, 6, 7], [0, 1, 2, 3])):
        q, k, v, gate, cache, cu = _step(1, lengths, starts, slots, torch.float32, gated=True)
        ref = _run("correctness", q, k, v, gate, cache, cu, starts, slots, None)
        got = _run("performance", q, k, v, gate, cache, cu, starts, slots, None)
        assert torch.equal(got[1], ref[1])
        assert (got[0] - ref[0]).abs().max().item() < 2e-5


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match="cu_seqlens"):
        KVStepPlan([1, 2], [0], [0])
    with pytest.raises(ValueError, match="2 starts and 1 slots"):
        KVStepPlan([0, 1, 2], [0, 0], [0])
    q, k, v, _, cache, cu = _step(0, [2], [0], [0], torch.float32, gated=False)
    with pytest.raises(ValueError, match="do not match q"):
        attention_with_kv_cache(
            q, k, v, cache, cache.clone(), torch.tensor([0]), torch.tensor(cu), plan=KVStepPlan([0, 1], [0], [0])
        )
    assert reference_attention.attention_with_kv_cache is not None


TRITON_SCRIPT = """
from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds
allow_runtime_loop_bounds()
import torch
from megatron_iso.ops.attention import KVStepPlan
from megatron_iso.ops.attention import attention_triton as at
torch.manual_seed(0)
b = lambda t: t.view(torch.int32)
for cu, starts, slots in (([0, 1, 2, 3], [5, 0, 20], [2, 0, 1]), ([0, 9, 10, 30], [0, 40, 3], [0, 1, 3])):
    t = cu[-1]
    q, k, v, g = (torch.randn(t, h, 16) for h in (8, 4, 4, 8))
    cache = torch.randn(4, 64, 4, 16)
    plan = KVStepPlan(cu, starts, slots)
    outs = []
    for layer in range(2):
        for p, dev in ((None, "cpu"), (plan, "meta")):
            kc, vc = cache.clone(), cache.flip(0).clone()
            o = at.attention_with_kv_cache(q, k, v, kc, vc, torch.tensor(starts, device=dev), torch.tensor(cu, device=dev),
                                           slots=torch.tensor(slots, device=dev), gate=g, kv_block=16, plan=p)
            outs.append((o, kc, vc))
    for got in outs[1:]:
        assert all(torch.equal(b(x), b(y)) for x, y in zip(got, outs[0])), (cu, starts, slots)
    assert sum(1 for key in plan._memo if key[0] == "triton_tables") == 1
print("ok")
"""


def test_triton_wrapper_plan_interpreter() -> None:
    """The Triton wrapper with a plan (layout tensors on the meta device, so unread) launches the same
    kernel on the same tables: same bits and cache as without, tables built once for two layers."""
    pytest.importorskip("triton")
    from megatron_iso.testing.triton_interpret import run_interpreted

    res = run_interpreted(TRITON_SCRIPT, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
