"""Routing replay (R3): the decoder records each token's experts, the trainer compares and replays them.

The performance-profile case needs routing that flips between rollout and trainer. The tiny MoE model in fp32 on
a CPU routes every token the same way on both sides (its rollout/trainer gap is ~5e-7 in logprob, far from any
router tie), so the test makes the flip itself: after the rollout the trainer's router weights move by a small
seeded perturbation, as another kernel's rounding would move near-tied logits. Without replay some (token, layer)
pairs then route elsewhere (agreement < 1); with replay every recorded pair uses the rollout's experts, bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_iso.inference import Request, SamplingParams
from megatron_iso.inference.engine import EngineConfig, RolloutEngine
from megatron_iso.models.batch import pack
from megatron_iso.models.scoring import score_sequences
from megatron_iso.parallel.world import single_process_world
from megatron_iso.rl.routing_replay import attach_routing
from megatron_iso.settings import SettingsError, check_config
from megatron_iso.settings.compose import load_config
from tests.inference.engine_cases import setup


def _rollout(profile: str):
    """The tiny MoE model, and its samples from an engine that records routing: two requests of 2 samples each
    (a shared prompt prefill forked in two), the second generated after the first and sharing its first KV block
    (a prefix-cache hit: those positions' routing comes from the first request's prefill)."""
    tc, model = setup(["model=tiny_moe", f"profile={profile}"])
    engine = RolloutEngine(model, EngineConfig(record_routing=True, block_size=4))
    g = torch.Generator().manual_seed(3)
    first = torch.randint(0, tc.vocab_size, (9,), generator=g).tolist()
    second = first[:4] + torch.randint(0, tc.vocab_size, (6,), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=11)
    outs = engine.generate([Request("a", first, params)]) + engine.generate([Request("b", second, params)])
    assert engine.stats.prefix_hit_tokens > 0  # the second request reused the first's block
    samples = [
        SimpleNamespace(prompt=SimpleNamespace(ids=list(o.prompt)), tokens=list(s.tokens), routing=s.routing)
        for o in outs
        for s in o.samples
    ]
    return tc, model, samples


def _trainer_forward(model, samples, replay: bool, seen: list[torch.Tensor] | None = None):
    """The trainer's pack of ``samples`` with their recorded routing, scored with autograd on; its routing target.
    ``seen``: every MoE layer's experts as the router returned them (models.moe.routed_experts' output)."""
    seqs = [s.prompt.ids + s.tokens for s in samples]
    ids, batch = pack(seqs)
    starts = batch.cu_seqlens_q.tolist()[:-1]
    attach_routing(batch, samples, starts, replay)
    logp, _ = score_sequences(model, ids, batch, with_entropy=False)
    return logp, batch.routing


def _wrap_routed(monkeypatch, seen: list[torch.Tensor]) -> None:
    import megatron_iso.models.moe as moe

    inner = moe.routed_experts

    def routed(own):
        used = inner(own)
        seen.append(used)
        return used

    monkeypatch.setattr(moe, "routed_experts", routed)


def _perturb_routers(model, scale: float) -> None:
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


@pytest.fixture
def world():
    with single_process_world():
        yield


def test_recorded_routing_covers_every_forwarded_position(world):
    tc, _, samples = _rollout("performance")
    for s in samples:
        # prompt + response - 1 positions (the last token was never an input), every layer, top-k ascending or not
        assert s.routing.shape == (len(s.prompt.ids) + len(s.tokens) - 1, tc.num_layers, tc.moe_router_topk)
        assert s.routing.dtype == torch.int64
        assert bool(((s.routing >= 0) & (s.routing < tc.num_moe_experts)).all())
    # the two samples of a request share the prompt's routing (one prefill, forked)
    p = len(samples[0].prompt.ids)
    assert torch.equal(samples[0].routing[:p], samples[1].routing[:p])


def test_performance_profile_replay_reproduces_flipped_routing(world, monkeypatch):
    _, model, samples = _rollout("performance")
    _perturb_routers(model, 0.05)  # the trainer's router now disagrees with the rollout's on some near ties
    _, own = _trainer_forward(model, samples, replay=False)
    agree, compared = own.agreement().tolist()
    assert compared == sum(len(s.prompt.ids) + len(s.tokens) - 1 for s in samples) * model.config.num_layers
    assert 0 < agree < compared, (agree, compared)

    seen: list[torch.Tensor] = []
    _wrap_routed(monkeypatch, seen)
    logp, replayed = _trainer_forward(model, samples, replay=True)
    agree, compared = replayed.agreement().tolist()
    assert agree < compared  # the counts are the router's own top-k against the record, replay or not
    assert len(seen) == model.config.num_layers
    valid = replayed.experts[:, 0, 0] >= 0
    for layer, used in enumerate(seen):
        # the experts the layer ran: the rollout's, bit for bit, on every recorded row
        assert torch.equal(used[valid], replayed.experts[valid, layer])
    # the gate is still the trainer's: the router weights get a gradient through the replayed experts
    logp.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.router.weight")]
    assert grads and all(g is not None and bool(g.abs().sum() > 0) and bool(torch.isfinite(g).all()) for g in grads)


def test_correctness_profile_trainer_routes_as_the_rollout_recorded(world):
    _, model, samples = _rollout("correctness")
    _, target = _trainer_forward(model, samples, replay=False)
    agree, compared = target.agreement().tolist()
    assert compared > 0 and agree == compared  # exactly 1.0, no replay needed


def test_correctness_loop_logs_routing_agreement_of_one(tmp_path):
    import json

    from megatron_iso.rl.run import train

    over = ["rl.group_size=2", "rl.max_response_length=3", "task.prompts_per_step=2", "rl.steps=1"]
    train(load_config([*over, "model=tiny_moe", "rl.routing_replay=true", f"out_dir={tmp_path / 'run'}"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["moe/routing_agreement"] for r in rows] == [1.0]
    assert rows[0]["mismatch/abs_diff_max"] == 0.0


def test_routing_replay_refused_for_a_dense_model():
    with pytest.raises(SettingsError) as err:
        check_config(load_config(["model=tiny_dense", "rl.routing_replay=true"]))
    line = str(err.value)
    assert "\n" not in line and line.startswith("rl.routing_replay=true needs an MoE model")


def test_routing_replay_refused_with_sequence_parallelism():
    with pytest.raises(SettingsError, match=r"rl.routing_replay=true is not supported with parallel.sp=true"):
        check_config(load_config(["model=tiny_moe", "rl.routing_replay=true", "parallel.tp=2", "parallel.sp=true"]))


def _counted(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


def test_decode_graph_buffers_record_the_routing_of_the_packed_steps(world):
    """A decode step served from the static bucket buffers (what a CUDA graph replays; run eagerly here, attention
    through the paged kernel's stand-in) records each token's experts as the packed decode step does."""
    from tests.inference.engine_cases import paged_reads_as_on_cuda

    _, model = setup(["model=tiny_moe"])
    reqs = [Request(i, list(range(3 + i, 10 + 2 * i)), SamplingParams(max_new_tokens=7, n=2, seed=1)) for i in range(3)]
    runs, served = [], []
    for graphs in (False, True):
        with paged_reads_as_on_cuda([], active=True):
            engine = RolloutEngine(model, EngineConfig(record_routing=True, block_size=4))
            if graphs:
                buckets = engine.enable_decode_graphs(capture=False)
                buckets.decode_step = _counted(buckets.decode_step, served)
            runs.append([s for o in engine.generate(reqs) for s in o.samples])
    assert served  # decode steps came from the bucket buffers
    for a, b in zip(*runs, strict=True):
        assert a.tokens == b.tokens and torch.equal(a.routing, b.routing)


def _used_agreement(seen: list[torch.Tensor], recorded: torch.Tensor) -> torch.Tensor:
    """``[2]``: (recorded token-layer pairs whose experts the layer ran equal the record as a set, pairs recorded)."""
    valid = recorded[:, 0, 0] >= 0
    same = [(torch.sort(u[valid], 1).values == torch.sort(recorded[valid, i], 1).values).all(1) for i, u in
            enumerate(seen)]  # fmt: skip
    return torch.stack([torch.cat(same).sum(), valid.sum() * len(seen)])


def _ep_replay_step(out_dir: str) -> dict:
    """One rank of EP=2 (tiny_moe, performance profile): a rollout recording routing, the routers perturbed alike on
    both ranks, then a full trainer update (forward, backward through the expert all-to-all, an optimizer step at
    lr 1e-9: the routers stay where the perturbation put them) without and with replay; the agreement of the experts
    the layers ran, summed over both ranks."""
    import dataclasses

    import torch.distributed as dist

    import megatron_iso.models.moe as moe
    import megatron_iso.rl.trainer as trainer_module
    from megatron_iso.parallel.world import seed_ranks
    from megatron_iso.rl.losses import group_advantages
    from megatron_iso.rl.trainer import Trainer
    from megatron_iso.settings import config_world, resolve

    over = ["model=tiny_moe", "profile=performance", "parallel.ep=2", "rl.group_size=2", "rl.max_response_length=5",
            "task.prompts_per_step=4", "rl.lr=1e-9", "rl.routing_replay=true", f"out_dir={out_dir}"]  # fmt: skip
    cfg = load_config(over)
    seen: list[torch.Tensor] = []
    inner = moe.routed_experts

    def routed(own):
        seen.append(inner(own))
        return seen[-1]

    pack, captured = trainer_module.pack_micro_batch, []

    def packed(*args, **kwargs):  # the trainer's own pack, kept for its routing target
        captured.append(pack(*args, **kwargs))
        return captured[-1]

    moe.routed_experts = routed  # a rank process of its own: nothing to restore
    trainer_module.pack_micro_batch = packed
    out = {}
    with config_world(cfg) as rank:
        seed_ranks(int(cfg.seed))
        trainer = Trainer(resolve(cfg), rank)
        samples = trainer.rollout(0)
        assert all(s.routing is not None for s in samples)
        adv = group_advantages(trainer.score_rewards(samples), 2)
        _perturb_routers(trainer.model, 0.05)  # the same seeded move on both ranks: the replicas stay equal
        for replay in (False, True):
            trainer.rl = dataclasses.replace(trainer.rl, routing_replay=replay)
            seen.clear()
            captured.clear()
            step = trainer.train_on(samples, adv)
            (mb,) = captured
            used = _used_agreement(seen, mb["batch"].routing.experts)
            dist.all_reduce(used)
            out[replay] = {"used": used.tolist(), "meter": trainer.routing_meter.metrics(),
                           "grad_norm": step["grad_norm"], "layers": len(seen)}  # fmt: skip
    return out


def test_expert_parallel_replay_runs_the_rollouts_experts(tmp_path):
    """EP=2 (gloo): the rollout's recorded routing rides the rollout batch to the trainer; with replay every recorded
    (token, layer) pair runs the rollout's experts through the all-to-all (agreement 1.0 exactly, both ranks); without
    it the perturbed routers route some elsewhere (below 1.0)."""
    from megatron_iso.testing.harness import run_on_ranks

    res = run_on_ranks(_ep_replay_step, 2, ep=2, args=(str(tmp_path / "run"),), timeout=300)
    assert res[0] == res[1]  # the all-reduced counts: every rank sees the same step
    off, on = res[0][False], res[0][True]
    for r in (off, on):
        assert r["layers"] == 2 and r["grad_norm"] > 0  # a real backward through the expert all-to-all
    agree, compared = on["used"]
    assert compared > 0 and agree == compared, on  # replay: the experts the layers ran are the rollout's
    agree, compared = off["used"]
    assert 0 < agree < compared, off  # without: some pairs ran other experts
    # moe/routing_agreement compares the routers' own top-k with the record, replay or not: below 1 both times
    assert off["meter"] == on["meter"] and 0 < off["meter"]["moe/routing_agreement"] < 1


def test_one_write_for_all_layers_equals_one_write_per_layer():
    """``record_step_routing_all`` (what a step's finish() writes): a contiguous run of layers in one stacked write,
    other layers one by one; either way the pool holds what per-layer writes leave, and rows the step does not
    write keep their old values."""
    from megatron_iso.inference.routing_record import record_step_routing, record_step_routing_all

    gen = torch.Generator().manual_seed(3)
    write_idx = torch.tensor([5, 0, 9, 2])
    for layers in ([0, 1, 2, 3], [1, 2], [0, 2, 3]):
        experts = {i: torch.randint(0, 60, (4, 2), generator=gen) for i in layers}
        one, each = torch.full((3, 4, 4, 2), -1, dtype=torch.int16), torch.full((3, 4, 4, 2), -1, dtype=torch.int16)
        record_step_routing_all(one, write_idx, experts)
        for i in layers:
            record_step_routing(each, write_idx, i, experts[i])
        assert torch.equal(one, each), layers
        flat = one.view(-1, 4, 2)
        assert (flat[[1, 3, 4]] == -1).all() and torch.equal(flat[5, layers[0]].long(), experts[layers[0]][0])
    with pytest.raises(ValueError, match="routed 3 rows"):
        record_step_routing_all(one, write_idx, {0: torch.zeros(3, 2, dtype=torch.long)})
