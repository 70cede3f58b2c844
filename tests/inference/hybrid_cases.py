"""Rank functions for the engine tests on models with Gated DeltaNet layers (tiny_hybrid,
tiny_hybrid_moe) and on tiny_moe: the engine's recorded logprobs, the trainer's recompute of the
finished sequences, and what the GDN slot cache did (prefix hits, flushes)."""

from __future__ import annotations

import torch

from tests.inference.engine_cases import STAGGERED_ARRIVALS, requests, run_schedule, setup, summary, trainer_scores

# GDN chunk 4: the SPECS prompts (1 to 17 tokens) and their 5 generated tokens cross chunk boundaries
# at every alignment (C-1, C, C+1, 2C+3, ...), in prefill and in decode.
CHUNK = 4


def _engine(model, **kw):
    from megatron_iso.inference import EngineConfig, RolloutEngine

    return RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4, **kw))


def schedules(overrides: list[str], batch_sizes: tuple[int, ...] = (1, 3, 8), staggered: bool = True) -> dict:
    """The SPECS requests in batches of each size (prefix caching on, and off at batch 3), and with
    staggered arrivals under ``max_num_seqs=4``; each run scored by the trainer."""
    tc, model = setup(overrides)
    reqs = requests(tc.vocab_size, max_new_tokens=5)
    runs = {}
    for bs in batch_sizes:
        for prefix in (True, False) if bs == 3 else (True,):
            outs = []
            for a in range(0, len(reqs), bs):
                outs += _engine(model, prefix_caching=prefix).generate(reqs[a : a + bs])
            runs[f"bs{bs}_prefix{prefix}"] = (summary(outs), trainer_scores(model, reqs, outs))
    if staggered:
        eng = _engine(model, max_num_seqs=4)
        outs = run_schedule(eng, reqs[::-1], STAGGERED_ARRIVALS)
        runs["staggered"] = (summary(outs), trainer_scores(model, reqs[::-1], outs))
    return runs


def group_reuse_and_flush(overrides: list[str]) -> dict:
    """A GRPO group (n=4) on a warm engine twice, then a weight sync: prefill sharing, no
    cross-request prefix hit, the contract's flush of the recurrent state, trainer equality."""
    from megatron_iso.inference import Request, SamplingParams
    from megatron_iso.models.weights import random_hf_state_dict

    tc, model = setup(overrides)
    prompt = torch.randint(0, tc.vocab_size, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    group = [Request("g", prompt, SamplingParams(n=4, max_new_tokens=4, seed=9))]
    eng = _engine(model)
    first = eng.generate(group)
    stats1 = dict(vars(eng.stats))
    second = eng.generate(group)
    out = {
        "first": summary(first),
        "second": summary(second),
        "first_trainer": trainer_scores(model, group, first),
        "prefill_tokens": (stats1["prefill_tokens"], eng.stats.prefill_tokens - stats1["prefill_tokens"]),
        "hit_tokens": eng.stats.prefix_hit_tokens,
        "kv_cached_blocks": eng.kv.cached_blocks,
        "slots_free": (eng.gdn.free_units(), eng.gdn.capacity()),
        "alone": summary(_engine(model, prefix_caching=False).generate(group)),
    }
    eng.load_hf_weights(random_hf_state_dict(tc, seed=8))
    out["flushes"] = eng.gdn.flushes
    out["state_zero"] = all(
        bool((getattr(layer, f) == 0).all()) for layer in eng.gdn.state.layers.values() for f in vars(layer)
    )
    after = eng.generate(group)
    out["after"] = summary(after)
    out["after_trainer"] = trainer_scores(model, group, after)
    out["fresh"] = summary(_engine(model).generate(group))
    return out


def native_gap(overrides: list[str]) -> float:
    """Performance profile: max |rollout logprob - trainer logprob| over the SPECS requests."""
    tc, model = setup(["profile=performance", *overrides])
    reqs = requests(tc.vocab_size, max_new_tokens=5)
    outs = _engine(model).generate(reqs)
    s, t = summary(outs), trainer_scores(model, reqs, outs)
    return max(float((s[k][1] - t[k]).abs().max()) for k in s)
