"""Routing record and replay (R3) for MoE layers: which experts a token's router selected, per layer.

Why: in the performance profile the rollout and the trainer may route a token differently (near-tie router
logits, other kernels), so the trainer's MoE computes another function than the one that sampled the token.
Routing replay (``rl.routing_replay``, Megatron-LM's and slime's R3) records each token's top-k experts in the
rollout and makes the trainer use them; the gate weights are still the trainer's own softmax at those experts,
so the router's gradient flows as without replay.

Both MoE routers (``models.moe.IsoTopKRouter`` and, in the performance profile, ``ReplayTopKRouter`` over
Megatron's ``TopKRouter``) pass their own top-k through :func:`routed_experts`, inside the scope their
transformer layer opens (:func:`routing_scope`: the layer's global index and the model call's batch). The batch
says what to do:

- a rollout step (``IsoBatch.kv_cache`` offers ``record_routing``, ``inference.routing_record``): the experts are
  written beside the step's keys, at their KV-cache rows, on the device (no host read; a captured decode step
  records inside its graph);
- a trainer pack with :class:`RoutingTarget` (``IsoBatch.routing``): the recorded experts of every row (-1 where
  none was recorded: a sequence's last token, filler rows). Each layer of a training forward (autograd on) counts
  the rows whose own top-k set equals the recorded one (``moe/routing_agreement``) and, with ``replay``, every
  forward uses the recorded experts instead.

The scope is opened by the layer's forward, which activation recompute reruns in the backward, so a recomputed
layer replays the same experts (the counts are overwritten with the same values, not added).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

_SCOPE: contextvars.ContextVar[tuple[int, object] | None] = contextvars.ContextVar("iso_routing_scope", default=None)


@dataclass
class RoutingTarget:
    """A trainer pack's recorded routing: ``experts [T, L, k]`` int64 on the pack's device (row t, global layer
    l; -1 rows: none recorded), whether the layers use it (``replay``) or only compare, and the per-layer counts
    ``(rows agreeing, rows recorded)`` the layers leave (shared by the context-parallel cuts of the pack)."""

    experts: torch.Tensor
    replay: bool
    counts: dict[int, torch.Tensor] = field(default_factory=dict)

    def cut(self, index: torch.Tensor, pad: int) -> RoutingTarget:
        """The rows ``index`` of the pack padded with ``pad`` unrecorded rows (a context-parallel rank's share)."""
        experts = self.experts
        if pad:
            experts = torch.cat([experts, experts.new_full((pad, *experts.shape[1:]), -1)])
        return RoutingTarget(experts[index.to(experts.device)], self.replay, self.counts)

    def agreement(self) -> torch.Tensor:
        """``[2]`` int64 on the device: (token-layer pairs whose trainer top-k set equals the rollout's, pairs
        compared), summed over the layers that ran; no host read."""
        if not self.counts:
            return torch.zeros(2, dtype=torch.int64, device=self.experts.device)
        return torch.stack(list(self.counts.values())).sum(0)


@contextlib.contextmanager
def routing_scope(layer_index: int, batch: object) -> Iterator[None]:
    """Inside: the MoE router of global layer ``layer_index`` (0-based) routes the rows of ``batch``."""
    token = _SCOPE.set((layer_index, batch))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _rows(experts: torch.Tensor, n: int) -> torch.Tensor | None:
    """This rank's ``n`` router rows of the pack's ``experts``: all of them, or under sequence parallelism (each
    TP rank routes ``T / TP`` rows) the rank's contiguous share; None when ``n`` fits neither."""
    total = experts.shape[0]
    if n == total:
        return experts
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if n * tp != total:
        return None
    rank = parallel_state.get_tensor_model_parallel_rank()
    return experts[rank * n : (rank + 1) * n]


def routed_experts(own: torch.Tensor) -> torch.Tensor:
    """The experts ``[N, k]`` the calling router's layer uses, given the router's own top-k ``own``: recorded
    (rollout), compared and possibly replayed (trainer), as the scope's batch says (module docstring)."""
    scope = _SCOPE.get()
    if scope is None:
        return own
    layer, batch = scope
    record = getattr(getattr(batch, "kv_cache", None), "record_routing", None)
    if record is not None:
        record(layer, own)
    target = getattr(batch, "routing", None)
    if not isinstance(target, RoutingTarget):
        return own
    recorded = _rows(target.experts, own.shape[0])
    if recorded is None:
        raise ValueError(
            f"rl.routing_replay: the router routes {own.shape[0]} rows, the pack's recorded routing has "
            f"{target.experts.shape[0]}"
        )
    recorded = recorded[:, layer].to(own.device)
    if recorded.shape[1] != own.shape[1]:
        raise ValueError(f"rl.routing_replay: recorded top-{recorded.shape[1]} routing for a top-{own.shape[1]} router")
    valid = recorded[:, 0] >= 0
    if torch.is_grad_enabled():  # training forwards only: a frozen reference model's forward would overwrite them
        same = (torch.sort(own, dim=1).values == torch.sort(recorded, dim=1).values).all(1) & valid
        target.counts[layer] = torch.stack([same.sum(), valid.sum()])
    if not target.replay:
        return own
    return torch.where(valid.unsqueeze(1), recorded, own)


def moe_layer_index(layer: torch.nn.Module) -> int:
    """A transformer layer's global 0-based index (Megatron's ``layer_number`` is 1-based and counts the
    pipeline stages before it)."""
    return int(layer.layer_number) - 1
