"""The mismatch benchmark: rollout logprobs (the bundled decoder) vs trainer logprobs over a grid.

A *layout* is (profile, TP, EP, SP, CP); each one runs as its own process group (see :data:`LAUNCHERS`),
and every batch size of the grid runs inside it. Per row, on every rank of the layout:

1. build the model from the same seeded random HF weights (digest recorded);
2. rollout: :class:`~megatron_iso.inference.engine.RolloutEngine` samples ``new_tokens`` per prompt
   and records each token's logprob (and, with ``full_vocab``, the step's full log-softmax through
   ``top_logprobs=V``, i.e. the engine's own gathered log-probabilities);
3. trainer: the prompt+response sequences in a fresh training-forward packing (SP-padded when SP is
   on), teacher-forced through :func:`~megatron_iso.models.scoring.score_sequences`; the full
   log-softmax comes from the same logits (a hook on the output layer) through
   ``parallel.vocab_scoring.log_softmax``, the function the engine uses;
4. statistics of |trainer - rollout| from :func:`megatron_iso.rl.metrics.mismatch_metrics`.

The rollout engine never runs sequence-parallel (decode rows do not split over ranks; production
decoders do not use SP either): with ``sp`` on, the trainer's model is SP and the rollout's model is
the same TP layout without SP, both built from the same weights. This is exactly the pairing the
invariance claim covers. Nor does it run context parallelism: with ``cp`` > 1 the trainer's pack is split over
the CP ranks (``models.context``) and its scores and full-vocab log-softmax are gathered back, while every CP rank
runs the rollout of the whole batch, as the RL loop's colocated engine does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron_iso.contract.lockfile import tensor_digest
from megatron_iso.rl.metrics import mismatch_metrics, peak_memory_bytes

# How one layout's ranks are started: (fn, world_size, tp=, ep=, args=, cp=) -> per-rank results.
# "gloo": forked CPU processes, one per rank (megatron_iso.parallel.launch).
# "torchrun": ranks started by `torchrun --nproc-per-node world_size` (megatron_iso.parallel.torchrun),
# one per GPU on cuda:<LOCAL_RANK> over NCCL when CUDA is available, gloo CPU ranks otherwise.
# The rank function below does not care how its world was made.
LAUNCHERS: dict[str, Callable[..., list[Any]]] = {}


def _gloo_launcher(
    fn: Callable[..., Any], world_size: int, *, tp: int, ep: int, args: Sequence[Any], cp: int = 1
) -> list[Any]:
    from megatron_iso.parallel.launch import run_on_ranks

    return run_on_ranks(fn, world_size, tp=tp, ep=ep, args=args, cp=cp)


def _torchrun_launcher(
    fn: Callable[..., Any], world_size: int, *, tp: int, ep: int, args: Sequence[Any], cp: int = 1
) -> list[Any]:
    from megatron_iso.parallel.torchrun import run_under_torchrun

    return run_under_torchrun(fn, world_size, tp=tp, ep=ep, args=args, cp=cp)


LAUNCHERS["gloo"] = _gloo_launcher
LAUNCHERS["torchrun"] = _torchrun_launcher


def check_launcher(launcher: str, field: str = "bench.launcher") -> str:
    """``launcher`` if it names one of :data:`LAUNCHERS`; else a ValueError naming the field."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"{field}={launcher!r} is not allowed; allowed values: {sorted(LAUNCHERS)}")
    return launcher


@dataclass(frozen=True)
class Layout:
    profile: str
    tp: int
    ep: int
    sp: bool
    cp: int = 1

    @property
    def world_size(self) -> int:
        # Every rank runs the same requests in lockstep; EP > TP needs data-parallel ranks to hold experts; each
        # of those is CP ranks that split the trainer's rows.
        return math.lcm(self.tp, self.ep) * self.cp

    @property
    def name(self) -> str:
        # CP 1 layouts keep the name they had before the CP axis (earlier reports stay comparable).
        return f"{self.profile}/tp{self.tp}/ep{self.ep}/sp{int(self.sp)}" + (f"/cp{self.cp}" if self.cp > 1 else "")


@dataclass(frozen=True)
class BenchSettings:
    """What every row shares: the root config (model, rl), the prompts, the sampling."""

    config: Mapping[str, Any] | None = None  # resolved root config (model, rl, ...); None: load_config()
    batches: tuple[int, ...] = (1, 8)
    prompt_len: tuple[int, int] = (4, 12)  # inclusive range of prompt lengths
    new_tokens: int = 8
    temperature: float = 1.0
    prompt_seed: int = 0
    sample_seed: int = 0
    weights_seed: int = 7
    full_vocab: bool = True
    kv_cache_mb: int = 16


def _check_choice(name: str, values: Sequence[Any], allowed: Callable[[Any], bool], what: str) -> None:
    bad = [v for v in values if not allowed(v)]
    if not values or bad:
        raise ValueError(f"bench.{name}={list(values)!r} is invalid; allowed: a non-empty list of {what}")


def layouts(
    profiles: Sequence[str], tp: Sequence[int], ep: Sequence[int], sp: Sequence[bool], cp: Sequence[int] = (1,)
) -> tuple[list[Layout], list[str]]:
    """The grid's layouts and notes on the combinations skipped (SP needs TP > 1)."""
    from megatron_iso.registry import PROFILES

    _check_choice("profiles", profiles, lambda p: p in PROFILES, f"profiles from {list(PROFILES)}")
    _check_choice("tp", tp, lambda v: isinstance(v, int) and v >= 1, "ints >= 1")
    _check_choice("ep", ep, lambda v: isinstance(v, int) and v >= 1, "ints >= 1")
    _check_choice("sp", sp, lambda v: isinstance(v, bool), "booleans")
    _check_choice("cp", cp, lambda v: isinstance(v, int) and v >= 1, "ints >= 1")  # the degrees: check_bench
    out, notes = [], []
    for p in profiles:
        for t in tp:
            for e in ep:
                for s in sp:
                    if s and t == 1:
                        notes.append(f"skipped {p}/tp1/ep{e}/sp1: sequence parallelism needs tp > 1")
                        continue
                    out += [Layout(p, t, e, s, c) for c in cp]
    return out, notes


def weights_digest(hf: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the HF-named weights (sorted names; each tensor's dtype, shape and raw bytes)."""
    h = hashlib.sha256()
    for name in sorted(hf):
        d = tensor_digest(hf[name])
        h.update(f"{name}|{d['dtype']}|{d['shape']}|{d['sha256']}\n".encode())
    return h.hexdigest()


def bench_prompts(settings: BenchSettings, batch: int, vocab: int) -> list[list[int]]:
    """The first ``batch`` prompts of one seeded stream: a row of batch 1 is the first row of batch 8."""
    lo, hi = settings.prompt_len
    if not 1 <= lo <= hi:
        raise ValueError(f"bench.prompt_len={[lo, hi]} is invalid; allowed: [min, max] with 1 <= min <= max")
    out = []
    for i in range(batch):
        g = torch.Generator().manual_seed(settings.prompt_seed * 1_000_003 + i)
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    return out


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None


def _full_log_softmax(logits: torch.Tensor, config, temperature: float) -> torch.Tensor:
    """The full-vocab fp32 log-softmax by the engine's own function (vocab gather is transport)."""
    from megatron_iso.parallel.tree_collectives import gather_along
    from megatron_iso.parallel.vocab_scoring import log_softmax

    group = _tp_group()
    logp = log_softmax(
        logits, temperature=temperature, group=group, leaves=config.iso_leaves, profile=config.iso_profile
    )
    return gather_along(logp, group, dim=-1)


def _rollout(model, prompts: list[list[int]], settings: BenchSettings) -> tuple[list[Any], float]:
    from megatron_iso.inference.engine import EngineConfig, RolloutEngine
    from megatron_iso.inference.params import Request, SamplingParams

    vocab = int(model.config.vocab_size)
    params = SamplingParams(
        temperature=settings.temperature,
        max_new_tokens=settings.new_tokens,
        seed=settings.sample_seed,
        top_logprobs=vocab if settings.full_vocab else 0,
    )
    engine = RolloutEngine(model, EngineConfig(kv_cache_bytes=settings.kv_cache_mb << 20))
    t0 = time.perf_counter()
    outs = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - t0
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"rollout request {o.request_id} failed: {o.error}")
    return outs, seconds


def _rollout_full(sample, vocab: int) -> torch.Tensor:
    full = torch.empty(len(sample.top_logprobs), vocab, dtype=torch.float32)
    for j, pairs in enumerate(sample.top_logprobs):
        ids, vals = zip(*pairs, strict=True)
        full[j, list(ids)] = torch.tensor(vals, dtype=torch.float32)  # python floats hold fp32 values exactly
    return full


def _trainer(model, seqs: list[list[int]], settings: BenchSettings) -> tuple[torch.Tensor, torch.Tensor | None, list]:
    """Teacher-forced logprobs [T] (and full log-softmax [T, V] when asked) plus cu_seqlens."""
    from megatron_iso.models.batch import pack, row_multiple
    from megatron_iso.models.context import shard_for_context
    from megatron_iso.models.scoring import score_sequences
    from megatron_iso.parallel.context import gather_scores

    tc = model.config
    # Ids checked against the vocab here, on the host: the scoring then reads none back (no sync per LM-head chunk).
    ids, batch = pack(seqs, pad_to_multiple=row_multiple(tc), vocab_size=tc.vocab_size)
    full = None
    with torch.no_grad():
        logp, _ = score_sequences(model, ids, batch, temperature=settings.temperature, with_entropy=False)
        # The whole vocab's logits of every row: one more forward, only when the full distribution is compared; under
        # context parallelism of this rank's rows, the log-softmax gathered back as the scores are.
        sharded = shard_for_context(ids, batch, tc) if settings.full_vocab else None
        if sharded is not None:
            local_ids, local = sharded
            full = gather_scores(
                _full_log_softmax(model.forward_packed(local_ids, local), tc, settings.temperature), local.cp
            )
        elif settings.full_vocab:
            full = _full_log_softmax(model.forward_packed(ids, batch), tc, settings.temperature)
    return logp, full, batch.cu_seqlens_q.tolist()


def _stats(rollout: torch.Tensor, trainer: torch.Tensor, clip: tuple[float, float]) -> dict[str, float]:

    m = mismatch_metrics(rollout, trainer, *clip)
    return {k.removeprefix("mismatch/").replace("abs_diff", "dlogp"): v for k, v in m.items()}


def layout_config(base: Mapping[str, Any] | None, layout: Layout) -> dict[str, Any]:
    """``base`` (a resolved root config) with the layout's profile and parallel sizes.

    The profile node is the stock one of the layout's profile, unless ``base`` already runs that
    profile (then its own node, with any ``profile.*`` overrides, is kept)."""
    from megatron_iso.settings.compose import load_config, plain_config

    stock = plain_config(load_config([f"profile={layout.profile}"]))
    cfg = dict(stock if base is None else base)
    if cfg["profile"]["name"] != layout.profile:
        cfg["profile"] = stock["profile"]
    cfg["parallel"] = {**cfg["parallel"], "tp": layout.tp, "ep": layout.ep, "sp": layout.sp, "cp": layout.cp}
    return cfg


def run_layout(config: dict[str, Any], settings: BenchSettings) -> list[dict[str, Any]]:
    """One layout (``config`` from :func:`layout_config`), every batch size; runs on every rank."""
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict

    tc = transformer_config(config)
    hf = random_hf_state_dict(tc, seed=settings.weights_seed)
    trainer_model = build_model(tc, hf).eval()
    rollout_model = trainer_model
    if tc.sequence_parallel:
        rollout = {**config, "parallel": {**config["parallel"], "sp": False}}
        rollout_model = build_model(transformer_config(rollout), hf).eval()
    digest = weights_digest(hf)
    vocab = int(tc.vocab_size)
    clip = (float(config["rl"]["clip_low"]), float(config["rl"]["clip_high"]))
    device = next(trainer_model.parameters()).device
    # Warm-up (first-call allocations, lazy imports) so the first row's tokens/s is not penalised.
    _rollout(rollout_model, bench_prompts(settings, 1, vocab), dataclasses.replace(settings, new_tokens=2))
    rows = []
    for b in settings.batches:
        prompts = bench_prompts(settings, b, vocab)
        outs, seconds = _rollout(rollout_model, prompts, settings)
        samples = [o.samples[0] for o in outs]
        seqs = [p + s.tokens for p, s in zip(prompts, samples, strict=True)]
        t_logp, t_full, cu = _trainer(trainer_model, seqs, settings)
        # Row start+len(prompt)-1+j of the packed trainer output scores generated token j.
        idx = torch.cat([torch.arange(len(s.tokens)) + cu[i] + len(prompts[i]) - 1 for i, s in enumerate(samples)])
        rollout_logp = torch.tensor([x for s in samples for x in s.logprobs], dtype=torch.float32)
        trainer_logp = t_logp[idx]
        row: dict[str, Any] = {
            "batch": b,
            "weights_sha256": digest,
            "prompts": prompts,
            "tokens": [s.tokens for s in samples],
            "rollout_logprobs": rollout_logp.tolist(),
            "trainer_logprobs": trainer_logp.tolist(),
            **_stats(rollout_logp, trainer_logp, clip),
            "generated_tokens": int(rollout_logp.numel()),
            "rollout_seconds": seconds,
            "tokens_per_s": rollout_logp.numel() / seconds if seconds > 0 else float("inf"),
        }
        if t_full is not None:
            r_full = torch.cat([_rollout_full(s, vocab) for s in samples])
            diff = (r_full.double() - t_full[idx].double()).abs()
            row["full_vocab_dlogp_max"] = float(torch.nan_to_num(diff, nan=0.0).max())
        row["peak_mem_mb"] = peak_memory_bytes(device) / 2**20
        rows.append(row)
    return rows


def run_grid(
    layouts_: Sequence[Layout],
    settings: BenchSettings,
    *,
    launcher: str = "gloo",
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every layout in its own process group; rows in grid order (layout-major, then batch)."""
    launch = LAUNCHERS[check_launcher(launcher)]
    rows = []
    for lay in layouts_:
        config = layout_config(settings.config, lay)
        per_rank = launch(run_layout, lay.world_size, tp=lay.tp, ep=lay.ep, args=(config, settings), cp=lay.cp)
        first = per_rank[0]
        for i, row in enumerate(first):
            # Ranks run in lockstep on gathered log-probabilities: a disagreement is a bug, not noise.
            if any(r[i]["tokens"] != row["tokens"] for r in per_rank[1:]):
                raise RuntimeError(f"{lay.name} batch {row['batch']}: ranks sampled different tokens")
            out = {"layout": lay.name, **asdict(lay), "world_size": lay.world_size, **row}
            out["peak_mem_mb"] = max(r[i]["peak_mem_mb"] for r in per_rank)
            rows.append(out)
            if on_row is not None:
                on_row(out)
    return rows
