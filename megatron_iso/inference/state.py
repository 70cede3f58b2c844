"""The per-layer decoding-state abstraction the engine schedules against.

Each layer kind keeps its own state per sequence: attention layers keep keys/values (a paged
block cache, :mod:`megatron_iso.inference.kv_blocks`); a Gated DeltaNet layer keeps its short-conv
window and recurrent state (one slot per sequence, :mod:`megatron_iso.inference.gdn_slots`). The
engine only talks to :class:`SequenceStateCache`; each step it asks every cache for a step view and
hands them to the model inside one :class:`StepState` (the ``IsoBatch.kv_cache`` field), where an
attention layer calls ``layer(i)`` and any other layer kind calls ``state(kind)``; the engine also
passes the GDN view's cache and slots as ``IsoBatch.gdn_cache`` / ``gdn_slots``.

Capacity is counted in each cache's own units (KV blocks, GDN slots): the engine admits a request
only when every cache can reserve its worst case, so a running sequence never stalls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from megatron_iso.inference.routing_record import record_step_routing_all


@runtime_checkable
class SequenceStateCache(Protocol):
    kind: str  # "attention_kv", "gdn_state", ...

    def match_prefix(self, tokens: Sequence[int]) -> int:
        """Leading tokens whose state is cached and reusable (0 if the cache cannot reuse prefixes)."""

    def admit(self, seq_id: int, tokens: Sequence[int], num_cached: int) -> None:
        """Start a sequence whose first ``num_cached`` tokens' state comes from the prefix cache."""

    def fork(self, parent: int, child: int) -> None:
        """``child`` continues from ``parent``'s current state (shared read-only, copied on write)."""

    def prepare_append(self, seq_id: int, start: int, count: int) -> None:
        """Make positions ``start .. start+count-1`` writable for this sequence."""

    def commit_prefix(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Offer this sequence's state for ``tokens`` (already computed) to later prefix matches."""

    def release(self, seq_id: int) -> None:
        """The sequence is done: drop its references."""

    def flush(self) -> None:
        """Forget every reusable prefix (weights changed); running sequences must be none."""

    def cost(self, prompt_len: int, total_len: int, n: int, shared: bool, num_cached: int) -> int:
        """Worst-case units a request needs: ``n`` samples of up to ``total_len`` tokens each."""

    def remaining(self, seq_id: int, total_len: int) -> int:
        """Units this running sequence may still take before reaching ``total_len`` tokens (its
        reservation; admission subtracts the sum over running sequences from :meth:`free_units`)."""

    def free_units(self) -> int:
        """Units available to new reservations (free or reclaimable)."""

    def capacity(self) -> int:
        """All units of the cache."""

    def step_view(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> Any:
        """What this step's model forward reads and writes for the packed sequences, in order."""


class StepState:
    """The ``IsoBatch.kv_cache`` of one engine step: every cache's view of the packed sequences.

    Sequence ``i`` of the pack is slot ``i`` of the KV view; the GDN view names each sequence's own
    slot (``IsoBatch.gdn_slots``). Attention layers call
    :meth:`layer` (``(k_cache, v_cache)`` as the attention kernels take them) or, where the kernel
    reads a paged pool (``ops.attention.paged_kv_reads``), :meth:`paged_layer`; other layer kinds
    call :meth:`state` with their cache's ``kind``.
    """

    def __init__(self, views: dict[str, Any], *, paged: bool = True) -> None:
        self.views = views
        self.paged = paged  # attention may read the KV pool in place (EngineConfig.paged_kv_reads)
        self._routing: dict[int, torch.Tensor] = {}  # this step's MoE experts per layer, written at finish()

    def layer(self, index: int) -> Any:
        return self.views["attention_kv"].layer(index)

    def paged_layer(self, index: int) -> Any:
        """The KV view's pool and block tables for a kernel that reads blocks in place (no staging)."""
        return self.views["attention_kv"].paged_layer(index)

    def state(self, kind: str) -> Any:
        if kind not in self.views:
            raise KeyError(f"no {kind!r} state in this step; have {sorted(self.views)}")
        return self.views[kind]

    def record_routing(self, layer: int, experts: torch.Tensor) -> None:
        """An MoE layer's top-k ``experts [T, k]`` of the step's rows, kept beside their keys when the KV cache
        records routing (``inference.routing_record``); a no-op otherwise. Written at :meth:`finish`, all layers
        at once (a layer run again, as after a forward that raised, replaces its entry)."""
        view = self.views.get("attention_kv")
        if view is not None and view.cache.routes is not None:
            self._routing[layer] = experts

    def finish(self) -> None:
        """Write back whatever the views staged, and the step's recorded routing (called once after the forward)."""
        routing, self._routing = self._routing, {}
        if routing:
            view = self.views["attention_kv"]
            record_step_routing_all(view.cache.routes, view.write_idx, routing)
        for view in self.views.values():
            done = getattr(view, "finish", None)
            if done is not None:
                done()
