"""The rollout side of the RL loop when its layout differs from the trainer's.

``rollout.parallel.tp`` equal to the trainer's ``parallel.tp`` (the default): the decoder runs the
trainer's own modules (colocated, nothing here is used; the layout is decided by
:func:`megatron_iso.settings.rollout_layout`). Otherwise, or with a pipelined trainer
(``parallel.pp`` > 1: the rollout is never pipelined, the stages' weights are joined), a :class:`LayoutRollout` builds
its own Megatron layout on the same ranks (:class:`~megatron_iso.parallel.layouts.ParallelLayout`)
and its own model in it. After every optimizer step :meth:`LayoutRollout.sync` all-gathers the
trainer's TP shards into full HF-named weights and loads them (only data moves; the engine's caches
are flushed). Every rollout DP rank generates a share of the step's requests and the outputs are
exchanged, so each trainer rank finds the samples of its own DP share. With the correctness profile,
TP inside ``profile.tp_domain`` is a deployment knob: the samples and their logprobs are the bits
the colocated decoder would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_iso.inference.engine import EngineConfig, RolloutEngine
from megatron_iso.inference.params import Request, RequestOutput
from megatron_iso.models.stages import Stage, current_stage, to_global_names
from megatron_iso.models.transformer_config import transformer_config
from megatron_iso.models.weights import hf_from_megatron_shards
from megatron_iso.parallel.layouts import ParallelLayout
from megatron_iso.rl.pipeline import join_stage_shards
from megatron_iso.settings import Settings


def gather_hf_weights(model: torch.nn.Module, group: Any, stage: Stage | None = None) -> dict[str, torch.Tensor]:
    """Full HF-named weights of a TP-sharded model: every parameter all-gathered over ``group`` (rank
    order), then reassembled by :func:`~megatron_iso.models.weights.hf_from_megatron_shards`. A pipeline
    stage's (``stage`` given) are first named as in the whole model, and the stages' shards joined."""
    size = dist.get_world_size(group) if group is not None else 1
    params = {name: p.detach() for name, p in model.named_parameters()}
    if stage is not None:
        params = to_global_names(params, stage)
    shards: list[dict[str, torch.Tensor]] = [params] if size == 1 else [{} for _ in range(size)]
    for name, p in params.items() if size > 1 else ():
        parts = [torch.empty_like(p) for _ in range(size)]
        dist.all_gather(parts, p.contiguous(), group=group)
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part
    if stage is not None:
        shards = join_stage_shards(shards, stage.group)
    return hf_from_megatron_shards(shards, model.config)


class LayoutRollout:
    """A rollout model in its own layout on the trainer's ranks, fed the trainer's weights."""

    def __init__(self, settings: Settings, trainer_model: torch.nn.Module, engine_config: EngineConfig) -> None:
        """``settings``: the rollout side's (``settings.rollout_layout``), its parallel group the rollout's layout."""
        self.trainer_model = trainer_model
        self.trainer_tp_group = parallel_state.get_tensor_model_parallel_group()
        # The trainer's pipeline stage, read while its layout is active (None: not pipelined).
        self.trainer_stage = (
            current_stage(trainer_model.config) if trainer_model.config.pipeline_model_parallel_size > 1 else None
        )
        p = settings.parallel
        self.layout = ParallelLayout.create(p.tp, p.pp, p.ep)
        with self.layout.active():
            self.config = transformer_config(settings)
            self.dp_rank = parallel_state.get_data_parallel_rank()
            self.dp_size = parallel_state.get_data_parallel_world_size()
            # Building a model draws init weights (overwritten by the load) from the global RNG:
            # keep the trainer's random stream as the colocated run sees it.
            with torch.random.fork_rng(devices=[]):
                self.engine = RolloutEngine.from_hf_weights(self.config, self._trainer_weights(), engine_config)

    def _trainer_weights(self) -> dict[str, torch.Tensor]:
        return gather_hf_weights(self.trainer_model, self.trainer_tp_group, self.trainer_stage)

    def sync(self) -> None:
        """Copy the trainer's current weights into the rollout model (a collective over the trainer's TP
        group); the engine flushes its caches (contract rule: every cached state dropped on weight_sync)."""
        weights = self._trainer_weights()
        with self.layout.active():
            self.engine.load_hf_weights(weights)

    def generate(self, requests: Sequence[Request]) -> dict[str, RequestOutput]:
        """Generate this rollout DP rank's share of ``requests`` (every rank passes the same list) and
        exchange the outputs: every rank gets all of them, by request id."""
        with self.layout.active():
            mine = self.engine.generate(list(requests)[self.dp_rank :: self.dp_size])
        for sample in (s for o in mine for s in o.samples if s.routing is not None):
            sample.routing = sample.routing.cpu()  # recorded routing (MoE) crosses ranks as host tensors
        gathered: list[dict[str, RequestOutput]] = [{} for _ in range(dist.get_world_size())]
        # Ranks of one rollout TP group hold identical outputs (lockstep); any copy will do.
        dist.all_gather_object(gathered, {o.request_id: o for o in mine})
        return {rid: out for part in gathered for rid, out in part.items()}
