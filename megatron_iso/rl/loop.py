"""The synchronous colocated RL loop (GRPO / DAPO).

One step: prompts -> rollout (the bundled decoder running the trainer's own modules, n samples
per prompt) -> rewards -> trainer forward over prompt+response (the logprobs the loss uses) ->
group-normalised advantages -> policy loss -> optimizer step -> the decoder sees the new weights
(same parameter tensors; its prefix cache is flushed). With ``rollout.parallel.tp`` other than
``parallel.tp`` the decoder runs its own model in its own layout instead, and the weights are synced
after every optimizer step (:mod:`megatron_iso.rl.rollout`). In the correctness profile the trainer's
logprobs equal the rollout's bit for bit, so ``mismatch/abs_diff_max`` is 0 at every step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from megatron_iso.errors import NonFiniteError, UserError
from megatron_iso.rl.data import build_tasks
from megatron_iso.rl.dynamic_sampling import collect_step_batch
from megatron_iso.rl.losses import (
    PolicyLossConfig,
    group_advantages,
    overlong_penalty,
    policy_loss,
    untrained_step_line,
)
from megatron_iso.rl.metrics import MetricsLog, peak_memory_bytes, step_metrics
from megatron_iso.rl.optim import current_lr, scale_moe_aux_loss
from megatron_iso.rl.ppo import check_schedule, merge_updates, run_updates, step_normaliser
from megatron_iso.rl.rollout import LayoutRollout, rollout_parallel, separate_layout_needed, with_parallel
from megatron_iso.rl.routing_replay import RoutingMeter, records_routing
from megatron_iso.rl.sampling import generate_shares, train_params
from megatron_iso.rl.tasks import Prompt
from megatron_iso.rl.token_log import trained_token_ids
from megatron_iso.rl.validation import due, validate
from megatron_iso.settings import RLSettings, Settings, check_trainable, config_world, resolve


class RunSetupError(UserError, RuntimeError):
    """The run cannot start as configured (nothing was written)."""


@dataclass
class Sample:
    group: int
    prompt: Prompt
    tokens: list[int]
    rollout_logp: list[float]
    reward: float = 0.0
    finish_reason: str | None = None  # "length": truncated at rl.max_response_length
    old_logp: torch.Tensor | None = None  # pi_old from the rollout or a recompute (rl.ppo); None: the update's forward
    routing: torch.Tensor | None = None  # MoE: the rollout's experts per position and layer (rl.routing_replay)


def _loss_config(rl: RLSettings) -> PolicyLossConfig:
    return PolicyLossConfig(
        algo=rl.algo,
        clip_low=rl.clip_low,
        clip_high=rl.clip_high,
        aggregation=rl.aggregation,
        kl_coef=rl.kl_coef,
        correction=rl.rollout_correction,
    )


class Trainer:
    """Everything one rank holds for the run: model, optimizer, decoder, task, logs."""

    def __init__(self, cfg: DictConfig, rank: int, settings: Settings | None = None) -> None:
        """Build the run's parts in order, each from the typed ``settings`` (default: :func:`resolve` of ``cfg``;
        ``cfg`` itself is still what the rollout layout and the task read)."""
        from megatron.core import parallel_state

        self.cfg, self.rank = cfg, rank
        self.settings = settings if settings is not None else resolve(cfg)
        self.rl: RLSettings = self.settings.require("rl")
        self.loss_cfg = _loss_config(self.rl)
        self.micro_batch_seqs = self.rl.train_micro_batch_seqs
        self.run_dir: Path | None = self.settings.out_dir  # train() names it before building the Trainer
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tc = self._build_transformer_config()
        rollout_cfg, separate = self._build_contract()
        self._build_model()
        self._build_optimizer()
        self._build_engine(rollout_cfg, separate)
        self._build_task()
        self.ppo_schedule = check_schedule(self)  # (mini-batches per epoch, where pi_old comes from): rl.ppo

    def _build_transformer_config(self) -> Any:
        from megatron_iso.models.config import transformer_config

        return transformer_config(self.settings)

    def _build_contract(self) -> tuple[DictConfig, bool]:
        """Contract: the rollout side (the decoder) and the trainer must agree before anything runs. Returns the
        rollout's config (its layout) and whether that layout needs a model of its own."""
        from megatron_iso.contract import ContractValidationError, check_compatible, handshake
        from megatron_iso.settings import check_gpu_gemm_shapes, contract_for

        self.contract = contract_for(self.settings)
        if self.settings.device_class == "cuda":
            try:
                check_gpu_gemm_shapes(self.settings)
            except ContractValidationError as exc:
                raise RunSetupError(str(exc)) from exc
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            rollout_par = rollout_parallel(self.cfg, world)
            separate = separate_layout_needed(self.cfg, rollout_par)
        except ValueError as exc:
            raise RunSetupError(str(exc)) from exc
        rollout_cfg = with_parallel(self.cfg, rollout_par)
        try:
            rollout_contract = contract_for(rollout_cfg)
        except ContractValidationError as exc:
            raise RunSetupError(f"rollout.parallel: {exc}") from exc
        where = "rollout layout (rollout.parallel)" if separate else "rollout (colocated decoder)"
        check_compatible(self.contract, rollout_contract, where)
        handshake(self.contract)
        self.policy_digest = self.contract.identities.numerical_policy
        return rollout_cfg, separate

    def _build_model(self) -> None:
        """The policy from ``model.init_from`` or seeded random HF weights; a frozen copy of it for the KL term."""
        from megatron_iso.checkpoint.init_from import build_initial_model

        initial = (self.tc, self.settings.model.init_from, self.settings.require("seed"))
        self.model = build_initial_model(*initial)
        # KL to the initial policy: a frozen copy scored with the same function (rl.kl_coef > 0 only).
        self.ref_model = None
        if self.rl.kl_coef > 0:
            self.ref_model = build_initial_model(*initial).eval().requires_grad_(False)

    def _build_optimizer(self) -> None:
        from megatron_iso.rl.optim import build_optimizer

        self.ddp, self.optimizer, self.schedule = build_optimizer(self.tc, self.model, self.rl)

    def _build_engine(self, rollout_cfg: DictConfig, separate: bool) -> None:
        """Colocated: the decoder runs the trainer's own modules. Another layout: its own model, synced."""
        from megatron_iso.inference.engine import EngineConfig, RolloutEngine
        from megatron_iso.inference.phase_memory import RolloutMemory

        rollout = self.settings.require("rollout")
        engine_cfg = EngineConfig(
            kv_cache_bytes=rollout.kv_cache_bytes,
            paged_kv_reads=rollout.paged_kv_reads,
            cuda_graphs=rollout.cuda_graphs,
            record_routing=records_routing(self.tc, OmegaConf.to_container(rollout_cfg.parallel, resolve=True)),
        )
        self.routing_meter = RoutingMeter(engine_cfg.record_routing, next(self.model.parameters()).device)
        self.layout_rollout = LayoutRollout(rollout_cfg, self.model, engine_cfg) if separate else None
        self.engine = self.layout_rollout.engine if separate else RolloutEngine(self.model, engine_cfg)
        # The KV pool and GDN slots, freed while the trainer runs (rollout.release_in_training).
        self.rollout_memory = (
            RolloutMemory(self.engine) if rollout.release_in_training and self.engine is not None else None
        )

    def _build_task(self) -> None:
        self.tasks = build_tasks(self.cfg, self.settings, self.tc.vocab_size, self.engine, self.rank)
        self.task = self.tasks.train
        self.device = next(self.model.parameters()).device

    # --- one RL step ------------------------------------------------------------------------
    def rollout(self, step: int, draw: int = 0) -> list[Sample]:
        """This rank's samples of step ``step``'s generation batch ``draw`` (> 0: DAPO re-sampling, rl.dynamic_sampling)."""
        from megatron_iso.inference.params import Request

        every = self.task.resample_prompts(step, draw)
        prompts = every[self.dp_rank :: self.dp_size]
        params = train_params(self.rl, self.tasks.stop_ids, self.settings.require("seed"))
        tag = f"{step}" if draw == 0 else f"{step}+{draw}"

        # The request id keys the sampler's random stream: it names the step's batch, the trainer DP rank and the
        # prompt's place in that rank's share, whichever rollout rank generates it.
        def requests(d: int) -> list[Request]:
            return [Request(f"{tag}:{d}:{i}", p.ids, params) for i, p in enumerate(every[d :: self.dp_size])]

        samples = []
        for g, (prompt, out) in enumerate(zip(prompts, generate_shares(self, requests), strict=True)):
            for s in out.samples:
                samples.append(Sample(g, prompt, list(s.tokens), list(s.logprobs), finish_reason=s.finish_reason,
                                      routing=s.routing))  # fmt: skip
        return samples

    def score_rewards(self, samples: list[Sample]) -> torch.Tensor:
        rewards = torch.tensor([self.task.reward(s.prompt, s.tokens) for s in samples], dtype=torch.float32)
        if self.rl.overlong_buffer > 0:
            lengths = torch.tensor([len(s.tokens) for s in samples])
            rewards = rewards + overlong_penalty(
                lengths, self.rl.max_response_length, self.rl.overlong_buffer, self.rl.overlong_penalty
            )
        for s, r in zip(samples, rewards.tolist(), strict=True):
            s.reward = r
        return rewards

    def micro_batch_count(self, n_samples: int) -> int:
        """Forward/backward passes of a step over ``n_samples``, agreed by every rank: the largest count of any
        rank (0 only when no rank has a sample to train on). A data-parallel rank whose dynamic sampling kept
        fewer samples, or none, still takes part in every pass's collectives (expert all-to-all), the
        gradient sync and the optimizer step; before this, a rank with nothing kept skipped ``train_on`` and
        the others waited for it in the gradient all-reduce."""
        mine = len(self._micro_batch_bounds(n_samples))
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            mine = int(t.item())
        return mine

    def _micro_batch_bounds(self, n_samples: int) -> list[tuple[int, int]]:
        """``[a, b)`` sample ranges of this rank's micro-batches (``rl.train_micro_batch_seqs``; default one)."""
        size = self.micro_batch_seqs or max(1, n_samples)
        return [(a, min(a + size, n_samples)) for a in range(0, n_samples, size)]

    def train_on(
        self,
        samples: list[Sample],
        advantages: torch.Tensor,
        *,
        micro_batches: int | None = None,
        filler: Sample | None = None,
        publish: bool = True,
    ) -> dict[str, Any]:
        """One optimizer step on ``samples``; returns trainer logprobs of response tokens and stats.

        Forward and backward run over ``rl.train_micro_batch_seqs`` samples at a time (default: all at
        once), gradients accumulating in Megatron's grad buffers. Every micro-batch's loss is divided
        by the whole step's normaliser, so the accumulated gradient is the one-batch gradient; only
        the sum order of the weight gradients' reductions over tokens differs (backward is
        deterministic, not batch invariant). Logprobs, loss and statistics are the whole step's.

        ``micro_batches`` (:meth:`micro_batch_count`, the same on every rank) may exceed this rank's own
        count: the extra passes run ``filler`` with its loss and MoE aux loss scaled by 0, so they add exact
        zeros to the gradients and nothing to the logprobs or statistics. Samples' ``old_logp``: pi_old (rl.ppo).
        """
        from megatron.core.distributed import finalize_model_grads

        from megatron_iso.rl.pipeline import pipeline_passes

        bounds = self._micro_batch_bounds(len(samples))
        passes = len(bounds) if micro_batches is None else micro_batches
        if passes < len(bounds):
            raise ValueError(f"train_on: micro_batches={passes} < the {len(bounds)} this rank's samples need")
        if passes > len(bounds) and filler is None:
            raise ValueError("train_on: passes beyond this rank's micro-batches need a filler sample")
        # The step's response tokens in sample order: the loss is normalised over all of them.
        lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(samples)), lengths)
        every = torch.ones(seq_index.numel(), dtype=torch.bool)
        normaliser = step_normaliser(self.loss_cfg, samples, seq_index)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        scale_moe_aux_loss(self.tc, self.device, 1.0 / len(bounds) if bounds else 0.0)
        pipelined = self.tc.pipeline_model_parallel_size > 1  # Megatron's schedule over the stages (rl.pipeline)
        parts = pipeline_passes(self, samples, advantages, normaliser, bounds, passes, filler) if pipelined else []
        for j in range(0 if pipelined else passes):
            # As Megatron's schedules do: DP grad sync held back until the last micro-batch (it only
            # matters with overlap_grad_reduce; finalize_model_grads below does the sync).
            with self.ddp.no_sync() if j + 1 < passes else contextlib.nullcontext():
                if j < len(bounds):
                    a, b = bounds[j]
                    parts.append(self._accumulate_grads(samples[a:b], advantages[a:b], normaliser))
                else:
                    scale_moe_aux_loss(self.tc, self.device, 0.0)
                    self._accumulate_grads([filler], torch.zeros(1), normaliser, weight=0.0)

        def joined(i: int) -> torch.Tensor:  # a filler-only rank has no parts: no tokens
            return torch.cat([p[i] for p in parts]) if parts else torch.zeros(0, dtype=torch.float32)

        trainer_logp, rollout_logp, entropy, old_logp = joined(0), joined(1), joined(3), joined(4)
        ref_logp = joined(2) if self.ref_model is not None else None
        # Reported once over the whole step's tokens (the same bits for every micro-batch size), not
        # summed from micro-batches. pi_old as the backward saw it (one update reading its own forward: logp).
        with torch.no_grad():
            loss, stats = policy_loss(
                trainer_logp, old_logp, advantages, every, seq_index, self.loss_cfg,
                rollout_logp=rollout_logp, ref_logp=ref_logp, normaliser=normaliser,
            )  # fmt: skip
        # Megatron's full grad finalisation, not only the DP sync: replicated params that each TP rank
        # applies to its own heads or rows (q/k norms; norms under SP) need their grads summed over TP,
        # else the replicas drift apart from the first step on.
        finalize_model_grads([self.ddp])
        if self._grads_finite():
            ok, grad_norm, _ = self.optimizer.step()
            skipped = False
        elif self.rl.nonfinite == "stop":
            raise NonFiniteError(
                f"NaN or Inf in the gradients (loss {float(loss)}); the run stops before its weights take them "
                "(rl.nonfinite=skip drops such updates instead)"
            )
        else:  # rl.nonfinite=skip: the update is dropped, the weights stay as they were
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            ok, grad_norm, skipped = False, float("nan"), True
        t0 = time.perf_counter()
        if publish:
            self.publish_weights()
        return {
            "timing/weight_sync_s": time.perf_counter() - t0,
            "loss": float(loss),
            "grad_norm": float(grad_norm or 0.0),
            "update_ok": bool(ok),
            "nonfinite/skipped": float(skipped),
            "trainer_logp": trainer_logp,
            "old_logp": old_logp,
            "rollout_logp": rollout_logp,
            "entropy": entropy,
            **stats,
        }

    def _grads_finite(self) -> bool:
        """Whether every rank's gradients are finite (one reduction per tensor, one host sync, a MIN over ranks)."""
        flags = [
            torch.isfinite(g).all()
            for p in self.model.parameters()
            if (g := p.main_grad if getattr(p, "main_grad", None) is not None else p.grad) is not None
        ]
        ok = torch.stack(flags).all() if flags else torch.tensor(True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = ok.to(device=self.device, dtype=torch.int32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())
        return bool(ok)

    def _accumulate_grads(
        self, samples: list[Sample], advantages: torch.Tensor, normaliser: float, weight: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Forward and backward over one micro-batch (its loss divided by the step's ``normaliser``, times
        ``weight``); returns its response tokens' trainer, rollout and reference logprobs, entropies (empty
        without ``rl.log_entropy``) and old-policy logprobs, in sample order."""
        from megatron_iso.models.scoring import score_sequences
        from megatron_iso.rl.pipeline import pack_micro_batch

        mb = pack_micro_batch(self, samples, advantages, weight)
        ids, batch, mask, seq_index, rollout = mb["ids"], mb["batch"], mb["mask"], mb["seq_index"], mb["rollout"]
        # Only the response rows enter the loss: the prompt's rows are not scored (their LM head is skipped).
        how = {"temperature": self.rl.temperature, "rows": mask.nonzero()[:, 0].to(self.device)}
        logp, ent = score_sequences(self.ddp.module, ids, batch, with_entropy=self.rl.log_entropy, **how)
        # The loss runs on the host: one download of the logprobs (and entropies) per micro-batch.
        if ent is None:
            logp, ent = logp.float().cpu(), torch.zeros(0)
        else:
            both = torch.stack([logp.float(), ent.detach().float()]).cpu()
            logp, ent = both[0], both[1][mask].detach()  # the stack carries logp's graph: the statistic leaves it
        old = logp.detach() if mb["old"] is None else mb["old"]  # None: one update, pi_old is this forward's
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = score_sequences(self.ref_model, ids, batch, with_entropy=False, **how)[0].float().cpu()
        loss, _ = policy_loss(
            logp, old, advantages, mask, seq_index, self.loss_cfg,
            rollout_logp=rollout, ref_logp=ref, normaliser=normaliser,
        )  # fmt: skip
        (loss * weight if weight != 1.0 else loss).backward()
        return logp.detach()[mask], rollout[mask], None if ref is None else ref[mask], ent, old[mask]

    def publish_weights(self) -> None:
        """Make the trainer's current weights the decoder's (after an optimizer step or a checkpoint load)."""
        if self.rollout_memory is not None:
            self.rollout_memory.restore()  # the flush below writes the caches
        if self.layout_rollout is None:
            self.engine.on_weights_updated()  # same tensors, new values: cached prefixes are stale
        else:
            self.layout_rollout.sync()

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        collected = collect_step_batch(self, step)  # rollout batches, rewards, DAPO's filter and re-sampling
        samples, kept, gen_s, group_size = collected.samples, collected.kept, collected.gen_s, self.rl.group_size
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        t1 = time.perf_counter()
        metrics: dict[str, float] = {}
        passes = self.micro_batch_count(len(kept))  # every rank trains, or none (a collective)
        if passes:
            adv = torch.zeros(0)
            if kept:
                rewards_kept = torch.tensor([s.reward for s in kept])
                adv = group_advantages(rewards_kept, group_size, scale_by_std=self.rl.scale_adv_by_std)
            out = merge_updates(run_updates(self, kept, adv, passes=passes, filler=samples[0]))
            metrics |= {k: v for k, v in out.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            trainer_logp, rollout_logp, entropy, trained = (out[k] for k in ("trainer_logp", "rollout_logp",
                                                                             "entropy", "trained_lengths"))  # fmt: skip
        else:  # no rank kept a group: the metrics have no loss to show, so one line says why
            trainer_logp = rollout_logp = entropy = trained = torch.zeros(0, dtype=torch.long)
            if self.rank == 0:
                print(untrained_step_line(step, len(samples) // group_size * self.dp_size, collected.gen_batches),
                      file=sys.stderr)  # fmt: skip
        metrics["optim/lr"] = current_lr(self.optimizer)
        self.schedule.step(1)  # once per RL step, trained or not: a resumed run positions it by the step
        train_s = time.perf_counter() - t1
        # Mismatch, reward, response and entropy statistics over every DP rank's tokens and samples.
        local = {"trainer_logp": trainer_logp, "rollout_logp": rollout_logp, "entropy": entropy, "rewards": rewards,
                 "trained_lengths": trained, "token_ids": trained_token_ids(kept, trained),
                 "lengths": torch.tensor([len(s.tokens) for s in samples]),
                 "truncated": torch.tensor([s.finish_reason == "length" for s in samples])}  # fmt: skip
        self.step_tokens = self._gather(local)  # the log's worst tokens and |dlogp| histogram (rl.token_log)
        metrics |= step_metrics(self.step_tokens, self.loss_cfg.clip_low, self.loss_cfg.clip_high)
        metrics |= self.tasks.step_metrics(step)
        metrics |= self.routing_meter.metrics()  # moe/routing_agreement (a collective for MoE models)
        gen_tokens = sum(len(s.tokens) for s in samples) * self.dp_size
        step_s = time.perf_counter() - t0
        peak = peak_memory_bytes(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:  # the largest rank's, not rank 0's
            peak_t = torch.tensor([peak], dtype=torch.int64, device=self.device)
            dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
            peak = int(peak_t.item())
        metrics |= {
            "samples/kept_frac": len(kept) / max(1, len(samples)),
            "samples/gen_batches": float(collected.gen_batches),
            "timing/gen_s": gen_s,
            "timing/train_s": train_s,
            "timing/step_s": step_s,
            "throughput/gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9),
            "memory/peak_bytes": float(peak),
        }
        return metrics

    def _gather(self, item: Any) -> list[Any]:
        if self.dp_size == 1:
            return [item]
        out: list[Any] = [None] * self.dp_size
        dist.all_gather_object(out, item, group=self.dp_group)
        return out


# Keys a checkpoint must agree on with the run that resumes it. Not the layout: checkpoints reshard (rl.checkpoint),
# and the numerical policy digest already refuses a layout that changes bits (a pinned TP, another device class).
def _checkpoint_identity(trainer: Trainer) -> dict[str, Any]:
    return {"numerical_policy": trainer.policy_digest, **trainer.tasks.identity()}  # the data, in its order


def _checkpoint_layout(trainer: Trainer) -> dict[str, Any]:
    """Where a checkpoint was written (recorded in meta.json, not checked on resume)."""
    tc = trainer.tc
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "tp": tc.tensor_model_parallel_size,
            "pp": tc.pipeline_model_parallel_size, "ep": tc.expert_model_parallel_size, "dp": trainer.dp_size,
            "use_distributed_optimizer": trainer.rl.use_distributed_optimizer}  # fmt: skip


def run_identity(cfg: DictConfig) -> dict[str, Any]:
    """What a run trains: its model and task. Resuming with any other is refused, the differing keys named."""
    return {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "task")}


def _check_resumable(checkpoint: Path, cfg: DictConfig) -> None:
    from megatron_iso.rl.checkpoint import CheckpointError
    from megatron_iso.rl.run_dir import identity_diff

    saved = json.loads((checkpoint / "meta.json").read_text()).get("identity")
    if saved is None:
        raise CheckpointError(f"checkpoint {checkpoint} records no run identity (model, task); it cannot be resumed")
    diff = identity_diff(saved, run_identity(cfg))
    if diff:
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained with another model or task ({'; '.join(diff[:4])}"
            f"{'; ...' if len(diff) > 4 else ''}); resume with the same settings or choose a new out_dir"
        )


# Metrics whose values depend on wall-clock or memory, not on the computation: excluded when
# comparing a resumed run with an uninterrupted one.
TIMING_PREFIXES = ("timing/", "throughput/", "memory/")


def _plan_start(run_dir: Path, settings: Settings, cfg: DictConfig) -> Path | None:
    """The checkpoint to resume from in ``run_dir`` (None: a new run), by the rules of ``rl.run_dir``."""
    from megatron_iso.rl.checkpoint import latest_checkpoint
    from megatron_iso.rl.run_dir import plan_start

    resume_from = plan_start(run_dir, settings.resume, latest_checkpoint(run_dir) if run_dir.exists() else None)
    if resume_from is not None:
        _check_resumable(resume_from, cfg)
    return resume_from


def _new_run_dir(cfg: DictConfig, settings: Settings, rank: int) -> tuple[DictConfig, Settings]:
    """A run without ``out_dir``: a new ``runs/<UTC time>-<id>`` (the same on every rank), printed, and put into
    copies of ``cfg`` (what config.yaml and the logger record) and ``settings``."""
    from megatron_iso.rl.run_dir import default_run_dir

    run_dir = default_run_dir()
    if rank == 0:
        print(f"out_dir={run_dir} (a new run directory; out_dir=PATH chooses one)", file=sys.stderr)
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.out_dir = str(run_dir)
    return cfg, dataclasses.replace(settings, out_dir=run_dir)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.rl.steps`` RL steps in ``cfg.out_dir``: a new run (``resume=false``), the continuation of its
    latest checkpoint (``resume=true``), or either (``resume=auto``); the rules: ``rl.run_dir``. Without an
    ``out_dir`` (null) the run gets a new directory, named once the world is up and before anything is written."""
    from megatron_iso.checkpoint.init_from import apply_init_from
    from megatron_iso.checkpoint.run_ckpt import save_hf
    from megatron_iso.rl.checkpoint import finished_step, load_checkpoint, save_checkpoint
    from megatron_iso.rl.run_dir import locked_start

    # Megatron logs every DDP bucket's parameter names at INFO; keep the console to the progress bar.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    cfg = apply_init_from(cfg)  # model.init_from: the checkpoint's model group (and tokenizer)
    settings = resolve(cfg)
    check_trainable(settings)
    rl: RLSettings = settings.require("rl")
    # An out_dir given is checked before any world opens (a refusal writes nothing); the start is decided under the lock.
    if settings.out_dir is not None:
        resume_from = _plan_start(settings.out_dir, settings, cfg)
        done = None if resume_from is None else finished_step(resume_from, rl.steps)
        if done is not None:  # nothing left to run: no world, nothing written
            return {"run_dir": str(settings.out_dir), "steps_run": 0, "history": [], "dashboard": None,
                    "validation": {}, "finished_at": done}  # fmt: skip
    with contextlib.ExitStack() as stack:
        rank = stack.enter_context(config_world(settings))
        if settings.out_dir is None:
            cfg, settings = _new_run_dir(cfg, settings, rank)  # a directory no run has: nothing to resume
        run_dir: Path = settings.out_dir
        trainer = Trainer(cfg, rank, settings)
        # Locked once the run is built (a run that fails to build writes nothing), before anything is written;
        # the start (new or resumed) is decided under the lock, as another run may have written here meanwhile.
        resume_from = stack.enter_context(locked_start(run_dir, lambda: _plan_start(run_dir, settings, cfg), rank))
        start = 0
        if resume_from is not None:
            meta = load_checkpoint(
                resume_from, trainer.model, trainer.optimizer, _checkpoint_identity(trainer), rank=rank
            )
            start = int(meta["step"]) + 1
            trainer.schedule.step(start)
            trainer.publish_weights()
        identities = trainer.contract.identities.to_dict()
        if rank == 0:
            print(
                f"run {run_dir}: profile {settings.profile.name.value} on {settings.device_class}, contract "
                + ", ".join(f"{k} {v[:12]}" for k, v in sorted(identities.items())),
                file=sys.stderr,
            )
            # The first config stays config.yaml; a resumed run's own goes beside it.
            name = "config.yaml" if resume_from is None else f"config.resumed_step{start:06d}.yaml"
            (run_dir / name).write_text(OmegaConf.to_yaml(cfg, resolve=True))
        log = MetricsLog(
            run_dir,
            cfg.logger,
            {**OmegaConf.to_container(cfg, resolve=True), "contract": identities},
            resume_step=None if resume_from is None else start,
            enabled=rank == 0,
            summary=trainer.tasks.summary(),
        )
        steps = rl.steps
        every = rl.checkpoint_every
        meta = {**_checkpoint_identity(trainer), **_checkpoint_layout(trainer), "identity": run_identity(cfg),
                "contract": identities}  # fmt: skip
        history = []
        bar = _progress(range(start, steps), rank == 0)
        try:
            for step in bar:
                metrics = {**(validate(trainer, step) if due(rl, step) else {}), **trainer.step(step)}
                log.log(step, metrics, trainer.step_tokens)
                history.append(metrics)
                if rank == 0 and hasattr(bar, "set_postfix"):
                    bar.set_postfix(
                        reward=f"{metrics['reward/mean']:.3f}",
                        dlogp_max=f"{metrics.get('mismatch/abs_diff_max', 0):.2e}",
                    )
                if (step + 1) % every == 0 or step + 1 == steps:
                    save_checkpoint(run_dir, step, trainer.model, trainer.optimizer, meta, rank=rank,
                                    keep=rl.keep_checkpoints)  # fmt: skip
                if rl.save_hf_every and ((step + 1) % rl.save_hf_every == 0 or step + 1 == steps):
                    save_hf(run_dir, step, trainer.model, meta["identity"]["model"], trainer.tc, rank=rank)
            final = validate(trainer, steps) if due(rl, steps, last=True) else {}  # the trained policy's
            if final:
                log.log(steps, final)
            dashboard = log.write_dashboard()  # rank 0's, also to W&B; None elsewhere
        finally:
            log.close()
        return {"run_dir": str(run_dir), "steps_run": len(history), "history": history, "dashboard": str(dashboard),
                "validation": final}  # fmt: skip


def _progress(steps: range, show: bool):
    from tqdm.auto import tqdm

    return tqdm(steps, desc="rl steps", initial=steps.start, total=steps.stop, dynamic_ncols=True) if show else steps
