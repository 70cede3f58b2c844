"""Routing replay (R3, ``rl.routing_replay``) and ``moe/routing_agreement`` in the RL loop.

For an MoE model the decoder records each token's top-k experts per layer (``inference.routing_record``); every
sample brings its routing with it (``SampleOutput.routing`` -> ``Sample.routing``), so the recorded routing
travels with the rollout batch. :func:`attach_routing` puts a trainer pack's on its batch
(``models.routing.RoutingTarget``): the trainer's routers compare their own top-k with it, and with
``rl.routing_replay`` use it instead, in the forward and in a recomputing backward, at any EP size (the routing is
decided before the token dispatch, which only moves rows to the experts the routing names).

:class:`RoutingMeter` turns the comparisons into the step's ``moe/routing_agreement``: the fraction of (token,
layer) pairs whose trainer top-k set equals the rollout's, over the training forwards (autograd on: the frozen
reference model's and a pi_old recompute's forwards leave the counts alone) of every rank. 1.0 exactly in the
correctness profile, where rollout and trainer compute the same router logits bit for bit; in the performance
profile near-tied router logits can flip. The sums stay on the device until the step's end: one all-reduce and
one host read per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_iso.models.routing import RoutingTarget

AGREEMENT = "moe/routing_agreement"


def records_routing(tc: Any, rollout_parallel: dict[str, Any]) -> bool:
    """Whether the decoder records routing: an MoE model whose rollout layout has no sequence parallelism
    (``inference.routing_record``; ``settings.rl.check_routing_replay`` refuses replay without it)."""
    return bool(getattr(tc, "num_moe_experts", None)) and not (
        bool(rollout_parallel.get("sp", False)) and int(rollout_parallel.get("tp", 1)) > 1
    )


def attach_routing(batch: Any, samples: Sequence[Any], starts: Sequence[int], replay: bool) -> None:
    """Put the samples' recorded routing on their trainer pack ``batch`` (sample ``i``'s rows start at
    ``starts[i]``); rows without a record (each sample's last token, a filler sequence) keep -1, their own
    routing. Nothing when a sample has none (a model or layout that does not record)."""
    if not samples or any(getattr(s, "routing", None) is None for s in samples):
        return
    rows = int(batch.positions.numel())
    first = samples[0].routing
    device = batch.positions.device
    experts = torch.full((rows, *first.shape[1:]), -1, dtype=torch.int64, device=device)
    for start, s in zip(starts, samples, strict=False):
        recorded = s.routing.to(device, non_blocking=True)
        if recorded.shape[0] != len(s.prompt.ids) + len(s.tokens) - 1:
            raise ValueError(
                f"recorded routing covers {recorded.shape[0]} positions; the sample has "
                f"{len(s.prompt.ids) + len(s.tokens) - 1} (prompt + response - 1)"
            )
        experts[start : start + recorded.shape[0]] = recorded
    batch.routing = RoutingTarget(experts, replay)


class RoutingMeter:
    """The step's routing agreement: packs tracked as the trainer builds them, summed once at the step's end."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled, self.device = enabled, device
        self._targets: list[RoutingTarget] = []

    def track(self, batch: Any, weight: float) -> None:
        """A pack the trainer will run (a filler pass, ``weight`` 0, repeats a sample and is not counted)."""
        if self.enabled and weight != 0.0 and isinstance(batch.routing, RoutingTarget):
            self._targets.append(batch.routing)

    def metrics(self) -> dict[str, float]:
        """``{moe/routing_agreement: ...}`` over every rank's tracked packs (a collective when enabled; every
        rank calls it); empty for a model without routing or a step that compared nothing."""
        if not self.enabled:
            return {}
        total = torch.zeros(2, dtype=torch.int64, device=self.device)
        for target in self._targets:
            total += target.agreement().to(self.device)
        self._targets = []
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)  # TP replicas count the same rows: every pair weighs the same, the ratio holds
        agree, compared = total.tolist()
        return {AGREEMENT: agree / compared} if compared else {}
