"""The rollout's caches released while the trainer runs (inference.phase_memory): the storage is freed, and the
next rollout's tokens and recorded logprobs are the bits of an engine that never released it (dense with paged KV,
hybrid with GDN slots and prefix sharing, the performance profile's MoE with its serving copy of the expert weights,
which holds the updated weights after the update); a busy engine refuses to release."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.harness import run_on_ranks
from tests.inference.engine_cases import requests, setup

# The hybrid's GDN chunk crosses the prompts and the generated tokens at several alignments.
MODELS = [["model=tiny_dense"], ["model=tiny_hybrid", "profile.gdn_chunk=4"], ["model=tiny_moe", "profile=performance"]]


def _outputs(outs) -> list[tuple]:
    return [
        (o.request_id, s.index, s.tokens, torch.tensor(s.logprobs, dtype=torch.float32).view(torch.int32).tolist())
        for o in outs
        for s in o.samples
    ]


def _two_rollouts(overrides: list[str], release: bool) -> dict:
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from megatron_iso.inference.phase_memory import RolloutMemory, cache_tensors, serving_copies
    from megatron_iso.models.moe_serving import expert_stacks

    def held() -> list[torch.Tensor]:
        return cache_tensors(engine) + serving_copies(engine)

    tc, model = setup(overrides)
    engine = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4))
    memory = RolloutMemory(engine)
    reqs = requests(tc.vocab_size, max_new_tokens=5)
    first = engine.generate(reqs[:4])
    freed, storage_after_release = 0, None
    if release:
        freed = memory.release()
        storage_after_release = sum(t.untyped_storage().nbytes() for t in held())
        assert memory.release() == 0  # already released: nothing more
        memory.restore()
    with torch.no_grad():  # a trainer update: new weights, the engine told (caches flushed)
        for p in model.parameters():
            p.mul_(0.5)
    engine.on_weights_updated()
    second = engine.generate(reqs[4:] + reqs[:2])
    stacks = expert_stacks(model)
    fresh = all(
        torch.equal(stack.fc1[i], expert.linear_fc1.weight) and torch.equal(stack.fc2[i], expert.linear_fc2.weight)
        for stack in stacks
        for i, expert in enumerate(stack.experts.local_experts)
    )
    return {"first": _outputs(first), "second": _outputs(second), "freed": freed,
            "storage_after_release": storage_after_release, "stacks": len(stacks), "stacks_fresh": fresh,
            "resident": sum(t.untyped_storage().nbytes() for t in held())}  # fmt: skip


@pytest.mark.parametrize("overrides", MODELS, ids=["dense", "hybrid", "native_moe"])
def test_release_and_restore_keep_the_next_rollouts_bits(overrides):
    kept = run_on_ranks(_two_rollouts, 1, args=(overrides, False))[0]
    released = run_on_ranks(_two_rollouts, 1, args=(overrides, True))[0]
    assert released["freed"] == kept["resident"] > 0
    assert released["storage_after_release"] == 0
    assert released["resident"] == kept["resident"]
    assert released["first"] == kept["first"]
    assert released["second"] == kept["second"] and len(kept["second"]) > 0
    assert kept["stacks"] == (2 if "model=tiny_moe" in overrides else 0)
    assert kept["stacks_fresh"] and released["stacks_fresh"]


def _busy(overrides: list[str]) -> str:
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from megatron_iso.inference.phase_memory import RolloutMemory

    tc, model = setup(overrides)
    engine = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4))
    for r in requests(tc.vocab_size, max_new_tokens=5)[:2]:
        engine.add_request(r)
    engine.step()
    try:
        RolloutMemory(engine).release()
    except RuntimeError as exc:
        return str(exc)
    return "released"


def test_a_busy_engine_refuses_to_release():
    assert "still has sequences" in run_on_ranks(_busy, 1, args=(["model=tiny_dense"],))[0]
