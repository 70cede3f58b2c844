"""Shared rank functions for the engine tests: run the engine on the tiny dense model, then score
the finished sequences with the trainer's teacher-forced ``score_sequences``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from megatron_iso.testing.bits import bits

# (request id, prompt length, sampling params): mixed lengths across block boundaries, greedy and
# sampled, top-k/top-p, several samples per prompt.
SPECS = [
    (101, 5, {"temperature": 1.0, "n": 2}),
    (102, 1, {"temperature": 0.7, "top_k": 20}),
    (103, 12, {"temperature": 0.0}),
    (104, 3, {"temperature": 1.3, "top_p": 0.9, "n": 3}),
    (105, 9, {"temperature": 1.0, "top_k": 5, "top_p": 0.8}),
    (106, 17, {"temperature": 0.6, "n": 2}),
    (107, 2, {"temperature": 1.0}),
    (108, 7, {"temperature": 0.9, "top_k": 50}),
]
# Staggered arrivals: the step before which each SPECS request joins (:func:`run_schedule`).
STAGGERED_ARRIVALS = [0, 0, 1, 3, 4, 4, 6, 9]


def setup(overrides: list[str], seed: int = 7):
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    tc = transformer_config(load_config(overrides))
    return tc, build_model(tc, random_hf_state_dict(tc, seed=seed)).eval()


def requests(vocab: int, specs=SPECS, max_new_tokens: int = 6, **extra):
    from megatron_iso.inference import Request, SamplingParams

    out = []
    for rid, n, kw in specs:
        prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(rid)).tolist()
        params = SamplingParams(**{"max_new_tokens": max_new_tokens, "seed": 2024, **kw, **extra})
        out.append(Request(rid, prompt, params))
    return out


def trainer_scores(model, reqs, outs, pad_to_multiple: int = 1) -> dict:
    """(request id, sample) -> trainer logprobs of the generated tokens (teacher forced, one pack).
    ``pad_to_multiple``: the trainer's row padding (``row_multiple``: a filler sequence, so the row count divides
    by TP under SP), its rows scored at temperature 1."""
    from megatron_iso.models.batch import pack
    from megatron_iso.models.scoring import score_sequences

    seqs, temps, keys = [], [], []
    for r, o in zip(reqs, outs, strict=True):
        t = r.params.temperature if r.params.temperature > 0 else 1.0
        for s in o.samples:
            seqs.append(list(r.prompt) + s.tokens)
            temps += [t] * len(seqs[-1])
            keys.append((r.request_id, s.index, len(r.prompt), len(s.tokens)))
    ids, batch = pack(seqs, pad_to_multiple=pad_to_multiple)
    temps += [1.0] * (ids.shape[1] - len(temps))
    with torch.no_grad():
        logp, _ = score_sequences(model, ids, batch, temperature=torch.tensor(temps).unsqueeze(-1))
    cu = batch.cu_seqlens_q.tolist()
    return {(rid, i): logp[cu[j] + p - 1 : cu[j] + p - 1 + g] for j, (rid, i, p, g) in enumerate(keys)}


def assert_same_outputs(a: dict, b: dict, what: str) -> None:
    """Two :func:`summary` results: the same keys, tokens and finish reasons, logprobs equal bit for bit."""
    assert a.keys() == b.keys(), what
    for key, (tok, lp, reason) in a.items():
        tok2, lp2, reason2 = b[key]
        assert tok == tok2 and reason == reason2, (what, key)
        assert torch.equal(bits(lp), bits(lp2)), (what, key)


def summary(outs) -> dict:
    """(request id, sample) -> (tokens, fp32 logprobs, finish reason)."""
    return {
        (o.request_id, s.index): (s.tokens, torch.tensor(s.logprobs, dtype=torch.float32), s.finish_reason)
        for o in outs
        for s in o.samples
    }


def run_schedule(engine, reqs, arrivals: list[int]) -> list:
    """Add request i before step ``arrivals[i]``; step until all finish. Results in request order."""
    done, step = {}, 0
    while len(done) < len(reqs):
        for r, a in zip(reqs, arrivals, strict=True):
            if a == step:
                engine.add_request(r)
        for o in engine.step():
            done[o.request_id] = o
        step += 1
    return [done[r.request_id] for r in reqs]


def matrix(overrides: list[str], batch_sizes: tuple[int, ...] = (1, 3, 8)) -> dict:
    """Batch sizes 1/3/8 x prefix caching on/off, plus staggered arrivals; each scored by the trainer."""
    from megatron_iso.inference import EngineConfig, RolloutEngine

    tc, model = setup(overrides)
    reqs = requests(tc.vocab_size, max_new_tokens=5)
    runs = {}
    for bs in batch_sizes:
        for prefix in (True, False):
            outs = []
            for a in range(0, len(reqs), bs):
                eng = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4, prefix_caching=prefix))
                outs += eng.generate(reqs[a : a + bs])
            runs[f"bs{bs}_prefix{prefix}"] = (summary(outs), trainer_scores(model, reqs, outs))
    eng = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=4))
    outs = run_schedule(eng, reqs[::-1], STAGGERED_ARRIVALS)
    runs["staggered"] = (summary(outs), trainer_scores(model, reqs[::-1], outs))
    return runs


def full_vocab(overrides: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine top_logprobs over the whole vocab vs the trainer's full log-softmax at the same rows."""
    from megatron.core import parallel_state

    from megatron_iso.inference import EngineConfig, RolloutEngine
    from megatron_iso.models.batch import pack
    from megatron_iso.parallel.tree_collectives import gather_along
    from megatron_iso.parallel.vocab_scoring import log_softmax

    tc, model = setup(overrides)
    reqs = requests(tc.vocab_size, SPECS[:3], max_new_tokens=3, top_logprobs=tc.vocab_size)
    outs = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4)).generate(reqs)
    seqs, temps, engine_rows, rows = [], [], [], []
    for r, o in zip(reqs, outs, strict=True):
        t = r.params.temperature if r.params.temperature > 0 else 1.0
        for s in o.samples:
            base = sum(len(x) for x in seqs) + len(r.prompt) - 1
            seqs.append(list(r.prompt) + s.tokens)
            temps += [t] * len(seqs[-1])
            for g, top in enumerate(s.top_logprobs):
                row = torch.empty(tc.vocab_size, dtype=torch.float32)
                ids, vals = zip(*top, strict=True)
                row[list(ids)] = torch.tensor(vals, dtype=torch.float32)
                engine_rows.append(row)
                rows.append(base + g)
    ids, batch = pack(seqs)
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        logits = model.forward_packed(ids, batch)
        scaled = log_softmax(
            logits,
            temperature=torch.tensor(temps).unsqueeze(-1),
            group=group,
            leaves=tc.iso_leaves,
            profile=tc.iso_profile,
        )
        full = gather_along(scaled, group, dim=-1)
    return torch.stack(engine_rows), full[rows]


def throughput(overrides: list[str], batch: int, new_tokens: int) -> tuple[float, dict]:
    """Generated tokens per second of one generate() call (CPU, tiny model)."""
    from megatron_iso.inference import EngineConfig, RolloutEngine

    tc, model = setup(overrides)
    specs = [(200 + i, 16, {"temperature": 1.0}) for i in range(batch)]
    reqs = requests(tc.vocab_size, specs, max_new_tokens=new_tokens)
    eng = RolloutEngine(model, EngineConfig(kv_cache_bytes=4 << 20))
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    dt = time.perf_counter() - t0
    return sum(len(s.tokens) for o in outs for s in o.samples) / dt, vars(eng.stats)


def behaviour(overrides: list[str]) -> dict:
    """Prefill sharing, cross-request prefix reuse, weight-sync flush, stop tokens, per-request errors."""
    from megatron_iso.inference import EngineConfig, Request, RolloutEngine, SamplingParams
    from megatron_iso.models.weights import random_hf_state_dict

    tc, model = setup(overrides)
    out: dict = {}
    prompt = torch.randint(0, tc.vocab_size, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    group = [Request("g", prompt, SamplingParams(n=4, max_new_tokens=3, seed=9))]
    for prefix in (True, False):
        eng = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4, prefix_caching=prefix))
        res = eng.generate(group)
        out[f"group_prefix{prefix}"] = (summary(res), eng.stats.prefill_tokens)
    # Same prompt again on the warm engine: full prompt blocks come from the prefix cache.
    eng = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4))
    first = eng.generate(group)
    cached_after_first = eng.kv.cached_blocks
    before = eng.stats.prefill_tokens
    second = eng.generate(group)
    out["reuse"] = {
        "cached_blocks": cached_after_first,
        "second_prefill_tokens": eng.stats.prefill_tokens - before,
        "hit_tokens": eng.stats.prefix_hit_tokens,
        "same": _same(summary(first), summary(second)),
    }
    # Weight sync: new weights, the contract's flush, no stale hit; results match a fresh engine.
    new_weights = random_hf_state_dict(tc, seed=8)
    eng.load_hf_weights(new_weights)
    flushed = {"version": eng.weights_version, "cached_blocks": eng.kv.cached_blocks}
    hits = eng.stats.prefix_hit_tokens
    after = eng.generate(group)
    flushed["new_hits"] = eng.stats.prefix_hit_tokens - hits
    flushed["result_version"] = after[0].weights_version
    fresh = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4)).generate(group)
    flushed["same_as_fresh"] = _same(summary(after), summary(fresh))
    flushed["differs_from_old"] = not _same(summary(after), summary(first))
    flushed["trainer_equal"] = all(
        torch.equal(summary(after)[k][1].view(torch.int32), v.view(torch.int32))
        for k, v in trainer_scores(model, group, after).items()
    )
    out["flush"] = flushed
    # Stop tokens: stop on the 3rd greedy token.
    greedy = Request("s", prompt, SamplingParams(temperature=0.0, max_new_tokens=6))
    toks = eng.generate([greedy])[0].samples[0].tokens
    stop = Request("s", prompt, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(toks[2],)))
    stopped = eng.generate([stop])[0].samples[0]
    out["stop"] = (toks, stopped.tokens, stopped.finish_reason, toks.index(toks[2]))
    # Per-request errors next to good requests.
    small = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_model_len=32))
    bad = [
        Request(1, list(range(40)), SamplingParams()),
        Request(2, prompt, SamplingParams(temperature=-1.0)),
        Request(3, prompt, SamplingParams(top_p=0.0)),
        Request(4, [tc.vocab_size + 3], SamplingParams()),
        Request(5, prompt, SamplingParams(max_new_tokens=4)),
        Request(6, [], SamplingParams()),
        Request(7, prompt, SamplingParams(max_new_tokens=100)),  # clipped by max_model_len: 'length'
    ]
    res = small.generate(bad)
    out["errors"] = [(r.request_id, r.error, [(len(s.tokens), s.finish_reason) for s in r.samples]) for r in res]
    # The engine refuses a weight sync while sequences run.
    small.add_request(Request(8, prompt, SamplingParams(max_new_tokens=4)))
    small.step()
    try:
        small.on_weights_updated()
        out["sync_while_running"] = None
    except RuntimeError as exc:
        out["sync_while_running"] = str(exc)
    return out


def captured_vs_eager(eager: dict, captured: dict) -> tuple[int, float]:
    """``(samples with identical tokens, max |dlogp| up to each sample's first differing token)`` of two
    :func:`summary` dicts of the same requests (a performance-profile run, whose graphs may round differently)."""
    assert eager.keys() == captured.keys()
    same, worst = 0, 0.0
    for key, (tok, lp, _) in eager.items():
        tok2, lp2, _ = captured[key]
        k = next((i for i, (a, b) in enumerate(zip(tok, tok2, strict=False)) if a != b), min(len(tok), len(tok2)))
        same += tok == tok2
        worst = max(worst, float((lp[: k + 1] - lp2[: k + 1]).abs().max()) if k < len(lp) else 0.0)
    return same, worst


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and torch.equal(a[k][1].view(torch.int32), b[k][1].view(torch.int32)) for k in a
    )


def native_gap(overrides: list[str]) -> float:
    """Performance profile: max |rollout logprob - trainer logprob| over the SPECS requests."""
    tc, model = setup(["profile=performance", *overrides])
    from megatron_iso.inference import EngineConfig, RolloutEngine

    reqs = requests(tc.vocab_size, max_new_tokens=5)
    outs = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4)).generate(reqs)
    s, t = summary(outs), trainer_scores(model, reqs, outs)
    return max(float((s[k][1] - t[k]).abs().max()) for k in s)


def staggered_specs() -> list:
    """:data:`SPECS` with max_new_tokens 3 to 6: sequences leave the batch at different steps."""
    return [(rid, n, {**kw, "max_new_tokens": 3 + i % 4}) for i, (rid, n, kw) in enumerate(SPECS)]


class StaggeredRun(NamedTuple):
    """One :func:`staggered_run`: the engine after the run, the requests, their outputs (request order), and
    ``graphs_off``: why the engine as built served no decode graphs (its ``decode_graphs_off`` before the run
    enabled any)."""

    engine: Any
    requests: list
    outputs: list
    graphs_off: str | None

    @property
    def summary(self) -> dict:
        """:func:`summary` of the outputs."""
        return summary(self.outputs)

    @property
    def static_steps(self) -> int:
        """Decode steps served from bucket buffers (0 for an eager run)."""
        graphs = self.engine.decode_graphs
        return 0 if graphs is None else graphs.steps


def staggered_run(
    model,
    *,
    static: bool,
    buckets: list[int] | None = None,
    paged: bool = True,
    writes: list | None = None,
    watch: Callable[[Any], None] | None = None,
) -> StaggeredRun:
    """The decode-graph tests' staggered-engine run on CPU: the :func:`staggered_specs` requests (sequences leave
    the batch at different steps) on one engine (``max_num_seqs=6``, a 1 MiB KV cache in blocks of 4), request i
    joining before step ``STAGGERED_ARRIVALS[i]``, until all finish.

    ``static``: decode steps from the bucket buffers, run eagerly (``enable_decode_graphs(capture=False)``), with
    bucket sizes ``buckets`` in place of the default ones; else every step is eager (the engine built no decode
    graphs of its own, checked). ``paged``: attention reads the paged KV pool in place as on CUDA, through
    :func:`paged_reads_as_on_cuda` (its write indices appended to ``writes``); else the model's own attention.
    ``watch(engine)`` runs once the engine is set up, before the first request joins: where a test wraps the
    engine's or its graphs' methods to record what they do."""
    from megatron_iso.inference import EngineConfig, RolloutEngine

    with paged_reads_as_on_cuda(writes, active=paged):
        reqs = requests(model.config.vocab_size, staggered_specs())
        eng = RolloutEngine(model, EngineConfig(max_num_seqs=6, kv_cache_bytes=1 << 20, block_size=4))
        assert eng.decode_graphs is None, f"the engine built decode graphs of its own: {eng.decode_graphs_status()}"
        graphs_off = eng.decode_graphs_off
        if static:
            graphs = eng.enable_decode_graphs(capture=False)
            if buckets is not None:
                graphs.buckets = buckets
        if watch is not None:
            watch(eng)
        outs = run_schedule(eng, reqs, STAGGERED_ARRIVALS)
    return StaggeredRun(eng, reqs, outs, graphs_off)


def paged_kernel_standin(writes: list):
    """Attention through exactly what the paged Triton kernel reads from the device (no host plan): what the CPU
    tests of decode-graph buckets put in ``models.modules.attention_with_paged_kv_cache``. Every write index is
    appended to ``writes``."""
    from megatron_iso.ops.attention import KVStepPlan, attention_with_kv_cache

    def paged_call(q, k, v, paged, cache_seqlens, cu_seqlens_q, *, slots, plan, **common):
        del plan  # stale for a bucket's static batch: the kernel reads the device tensors below
        bs = paged.block_size
        own = KVStepPlan.from_tensors(cu_seqlens_q, cache_seqlens, slots)
        n, width = len(own.starts), paged.block_tables.shape[1]
        rows = paged.block_tables[slots]
        idx = (rows[:, :, None] * bs + torch.arange(bs)).reshape(n, width * bs)
        kp, vp = paged.k_pool.flatten(0, 1), paged.v_pool.flatten(0, 1)
        kp.index_copy_(0, paged.write_idx, k)  # the kernel's write, before it attends
        vp.index_copy_(0, paged.write_idx, v)
        writes.append(paged.write_idx.clone())
        kc = kp[idx.reshape(-1)].view(n, width * bs, *kp.shape[1:]).clone()
        vc = vp[idx.reshape(-1)].view(n, width * bs, *vp.shape[1:]).clone()
        # attention_with_kv_cache writes k/v at each start again (the same values) and attends.
        flat = KVStepPlan(own.cu, own.starts, list(range(n)))
        return attention_with_kv_cache(
            q, k, v, kc, vc, cache_seqlens, cu_seqlens_q, slots=torch.arange(n), plan=flat, **common
        )

    return paged_call


@contextlib.contextmanager
def paged_reads_as_on_cuda(writes: list | None = None, *, active: bool = True) -> Iterator[None]:
    """Inside: the correctness profile reads the paged KV pool in place, as on CUDA, through
    :func:`paged_kernel_standin` (appending its write indices to ``writes``); ``active=False`` leaves the model's
    attention as it is (the CPU's staged reads)."""
    from megatron_iso.models import modules

    saved = (modules.paged_kv_reads, modules.attention_with_paged_kv_cache)
    if active:
        modules.paged_kv_reads = lambda q, profile: profile == "correctness"
        modules.attention_with_paged_kv_cache = paged_kernel_standin([] if writes is None else writes)
    try:
        yield
    finally:
        modules.paged_kv_reads, modules.attention_with_paged_kv_cache = saved
