"""The RL trainer (GRPO / DAPO): what one rank holds for a run and one synchronous step of it.

The run around it (its directory, checkpoints, resume, logging) is :mod:`megatron_iso.rl.run`. One step: prompts -> rollout (the bundled decoder running the trainer's own modules, n samples
per prompt) -> rewards -> trainer forward over prompt+response (the logprobs the loss uses) ->
group-normalised advantages -> policy loss -> optimizer step -> the decoder sees the new weights
(same parameter tensors; its prefix cache is flushed). With ``rollout.parallel.tp`` other than
``parallel.tp`` the decoder runs its own model in its own layout instead, and the weights are synced
after every optimizer step (:mod:`megatron_iso.rl.rollout`). In the correctness profile the trainer's
logprobs equal the rollout's bit for bit, so ``mismatch/abs_diff_max`` is 0 at every step.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from megatron_iso.checkpoint.init_from import build_initial_model
from megatron_iso.contract import ContractValidationError, check_compatible, handshake
from megatron_iso.errors import NonFiniteError, UserError
from megatron_iso.inference.engine import EngineConfig, RolloutEngine
from megatron_iso.inference.params import Request
from megatron_iso.inference.phase_memory import RolloutMemory
from megatron_iso.models.transformer_config import IsoTransformerConfig, transformer_config
from megatron_iso.rl.data import build_tasks
from megatron_iso.rl.dynamic_sampling import collect_step_batch
from megatron_iso.rl.losses import (
    PolicyLossConfig,
    group_advantages,
    overlong_penalty,
    policy_loss,
    untrained_step_line,
)
from megatron_iso.rl.metrics import peak_memory_bytes, step_metrics
from megatron_iso.rl.optim import build_optimizer, current_lr, reset_moe_aux_tracker, scale_moe_aux_loss
from megatron_iso.rl.pipeline import pack_micro_batch, pipeline_passes, score_micro_batch
from megatron_iso.rl.ppo import check_schedule, merge_updates, run_updates, step_normaliser
from megatron_iso.rl.rollout import LayoutRollout
from megatron_iso.rl.routing_replay import RoutingMeter, records_routing
from megatron_iso.rl.sampling import generate_shares, train_params
from megatron_iso.rl.tasks import Prompt
from megatron_iso.rl.token_log import trained_token_ids
from megatron_iso.settings import RLSettings, Settings, check_gpu_gemm_shapes, contract_for, rollout_layout


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

    def __init__(self, settings: Settings, rank: int) -> None:
        """Build the run's parts in order, each from the typed ``settings`` (``megatron_iso.settings.resolve``)."""
        if not isinstance(settings, Settings):
            raise TypeError(f"Trainer takes Settings (megatron_iso.settings.resolve), got {type(settings).__name__}")
        self.rank = rank
        self.settings = settings
        self.rl: RLSettings = self.settings.require("rl")
        self.loss_cfg = _loss_config(self.rl)
        self.micro_batch_seqs = self.rl.train_micro_batch_seqs
        self.run_dir: Path | None = self.settings.out_dir  # train() names it before building the Trainer
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tc: IsoTransformerConfig = transformer_config(settings)
        rollout, separate = self._build_contract()
        reset_moe_aux_tracker(new_model=True)
        self._build_model()
        self.ddp, self.optimizer, self.schedule = build_optimizer(self.tc, self.model, self.rl)
        self._build_engine(rollout, separate)
        self._build_task()
        self.ppo_schedule = check_schedule(self)  # (mini-batches per epoch, where pi_old comes from): rl.ppo

    def _build_contract(self) -> tuple[Settings, bool]:
        """Contract: the rollout side (the decoder) and the trainer must agree before anything runs. Returns the
        rollout's settings (its layout) and whether that layout needs a model of its own."""
        self.contract = contract_for(self.settings)
        if self.settings.device_class == "cuda":
            try:
                check_gpu_gemm_shapes(self.settings)
            except ContractValidationError as exc:
                raise RunSetupError(str(exc)) from exc
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            rollout, separate = rollout_layout(self.settings, world)
        except ValueError as exc:
            raise RunSetupError(str(exc)) from exc
        try:
            rollout_contract = contract_for(rollout)
        except ContractValidationError as exc:
            raise RunSetupError(f"rollout.parallel: {exc}") from exc
        where = "rollout layout (rollout.parallel)" if separate else "rollout (colocated decoder)"
        check_compatible(self.contract, rollout_contract, where)
        handshake(self.contract)
        self.policy_digest = self.contract.identities.numerical_policy
        return rollout, separate

    def _build_model(self) -> None:
        """The policy from ``model.init_from`` or seeded random HF weights; a frozen copy of it for the KL term."""
        initial = (self.tc, self.settings.model.init_from, self.settings.require("seed"))
        self.model = build_initial_model(*initial)
        # KL to the initial policy: a frozen copy scored with the same function (rl.kl_coef > 0 only).
        self.ref_model = None
        if self.rl.kl_coef > 0:
            self.ref_model = build_initial_model(*initial).eval().requires_grad_(False)

    def _build_engine(self, layout: Settings, separate: bool) -> None:
        """Colocated: the decoder runs the trainer's own modules. Another layout (``layout``: the rollout side's
        settings): its own model, synced."""
        rollout = self.settings.require("rollout")
        engine_cfg = EngineConfig(
            kv_cache_bytes=rollout.kv_cache_bytes,
            paged_kv_reads=rollout.paged_kv_reads,
            cuda_graphs=rollout.cuda_graphs,
            record_routing=records_routing(self.tc, dict(layout.contract.parallel)),
        )
        self.routing_meter = RoutingMeter(engine_cfg.record_routing, next(self.model.parameters()).device)
        self.layout_rollout = LayoutRollout(layout, self.model, engine_cfg) if separate else None
        self.engine = self.layout_rollout.engine if separate else RolloutEngine(self.model, engine_cfg)
        # The KV pool and GDN slots, freed while the trainer runs (rollout.release_in_training).
        self.rollout_memory = (
            RolloutMemory(self.engine) if rollout.release_in_training and self.engine is not None else None
        )

    def _build_task(self) -> None:
        self.tasks = build_tasks(self.settings, self.tc.vocab_size, self.engine, self.rank)
        self.task = self.tasks.train
        self.device = next(self.model.parameters()).device

    # --- one RL step ------------------------------------------------------------------------
    def rollout(self, step: int, draw: int = 0) -> list[Sample]:
        """This rank's samples of step ``step``'s generation batch ``draw`` (> 0: DAPO re-sampling, rl.max_gen_batches)."""
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
        mb = pack_micro_batch(self, samples, advantages, weight)
        mask, seq_index, rollout = mb["mask"], mb["seq_index"], mb["rollout"]
        temperature = self.rl.temperature
        logp, ent = score_micro_batch(self.ddp.module, mb, temperature, self.device, self.rl.log_entropy)
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
                ref = score_micro_batch(self.ref_model, mb, temperature, self.device, False)[0].float().cpu()
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
        reset_moe_aux_tracker(new_model=False)
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
