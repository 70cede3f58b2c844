"""The Gated DeltaNet layers' :class:`~megatron_iso.inference.state.SequenceStateCache`.

A running sequence owns one slot of a :class:`~megatron_iso.ops.gdn.GDNStateCache` (conv window,
running and entry recurrent state, open-chunk buffer of every GDN layer). The model reads and writes
the slots in place: each step's pack carries them as ``IsoBatch.gdn_slots`` (no staging copy).

Prefix caching: a GDN state summarises every token before it, so it cannot be rebuilt from a prefix
of KV blocks, and this cache keeps no snapshots between requests: :meth:`GDNSlotCache.match_prefix`
returns 0, which turns cross-request prefix hits off for models with GDN layers (the engine takes the
minimum over its caches). The GRPO case, the ``n`` samples of one request sharing one prompt prefill,
is kept: the prompt's prefill leaves its state in the leader's slot, exactly the state at the prompt's
end, and :meth:`GDNSlotCache.fork` shares that slot with every sample (copy on write: the first write of
all but the last holder copies the whole slot, so a group of ``n`` needs ``n`` slots, never ``n + 1``).

Scratch slot: the state holds one slot more than ``num_slots``, :attr:`GDNSlotCache.scratch`, never handed to a
sequence (nor counted in the capacity): the padding rows of a decode graph's bucket point there (as their keys go to
the KV cache's reserved block), so padding never touches a sequence's state. Padding rows decode at position 0, which
the kernels read as a fresh sequence: they ignore what the scratch slot holds and overwrite it.

Contract rule ``recurrent_state flushed on weight_sync``: :meth:`GDNSlotCache.flush` refuses to run
while sequences hold slots and zeroes every slot (nothing computed with the old weights survives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from megatron_iso.ops.gdn import GDNStateCache


@dataclass
class GDNStepView:
    """What one step's GDN layers use: the cache itself and each packed sequence's slot."""

    cache: GDNStateCache
    slots: list[int]


class GDNSlotCache:
    kind = "gdn_state"

    def __init__(self, state: GDNStateCache, num_slots: int) -> None:
        """``state``: ``num_slots + 1`` slots per layer, the last one the scratch slot (:meth:`for_model`)."""
        if num_slots < 1:
            raise ValueError(f"GDNSlotCache: num_slots={num_slots} must be >= 1")
        held = {layer.conv.shape[0] for layer in state.layers.values()}
        if state.layers and held != {num_slots + 1}:
            raise ValueError(
                f"GDNSlotCache: the state must hold num_slots + 1 = {num_slots + 1} slots per layer (the last: the "
                f"scratch slot); it holds {sorted(held)}"
            )
        self.state, self.num_slots = state, num_slots
        self.scratch = num_slots  # decode graphs' padding rows: never a sequence's (module docstring)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.slot_of: dict[int, int] = {}
        self._holders: dict[int, list[int]] = {}  # slot -> sequences sharing it (the last one keeps it)
        self.lengths: dict[int, int] = {}
        self.flushes = 0

    @classmethod
    def for_model(cls, config, num_slots: int, device: torch.device | str = "cpu") -> GDNSlotCache:
        """``num_slots`` slots for every GDN layer of ``config`` (this TP rank's heads), and the scratch slot."""
        from megatron_iso.models.gdn import allocate_gdn_cache

        return cls(allocate_gdn_cache(config, num_slots + 1, device=device), num_slots)

    # --- per sequence ---------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> int:
        return 0  # no cross-request snapshots: see the module docstring

    def admit(self, seq_id: int, tokens: Sequence[int], num_cached: int) -> None:
        if num_cached:
            raise ValueError(f"GDNSlotCache.admit: num_cached={num_cached}; GDN state has no prefix hits (0 only)")
        self.lengths[seq_id] = 0  # the slot is taken at the first write: admission may still back out

    def fork(self, parent: int, child: int) -> None:
        self._hold(child, self.slot_of[parent])
        self.lengths[child] = self.lengths[parent]

    def prepare_append(self, seq_id: int, start: int, count: int) -> None:
        if start != self.lengths[seq_id]:
            raise ValueError(f"sequence {seq_id} appends at {start} but its GDN state holds {self.lengths[seq_id]}")
        slot = self.slot_of.get(seq_id)
        if slot is None:
            self._hold(seq_id, self._take())
        elif len(self._holders[slot]) > 1:  # shared prompt state: this sequence writes to its own copy
            new = self._take()
            for layer in self.state.layers.values():
                for f in fields(layer):
                    t = getattr(layer, f.name)
                    t[new] = t[slot]
            self._holders[slot].remove(seq_id)
            self._hold(seq_id, new)
        self.lengths[seq_id] = start + count

    def commit_prefix(self, seq_id: int, tokens: Sequence[int]) -> None:
        return None  # nothing is kept for later requests

    def release(self, seq_id: int) -> None:
        del self.lengths[seq_id]
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return
        holders = self._holders[slot]
        holders.remove(seq_id)
        if not holders:
            del self._holders[slot]
            self._free.append(slot)

    def flush(self) -> None:
        if self.lengths:
            raise RuntimeError(f"flush with {len(self.lengths)} running sequences; finish or abort them first")
        for layer in self.state.layers.values():
            for f in fields(layer):
                getattr(layer, f.name).zero_()
        self._free.sort(reverse=True)
        self.flushes += 1

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError("GDN state cache out of slots (the engine's reservation should have prevented this)")
        return self._free.pop()

    def _hold(self, seq_id: int, slot: int) -> None:
        self.slot_of[seq_id] = slot
        self._holders.setdefault(slot, []).append(seq_id)

    # --- capacity (units: slots) ----------------------------------------------------------
    def cost(self, prompt_len: int, total_len: int, n: int, shared: bool, num_cached: int) -> int:
        return n  # shared: the leader's slot passes to the last sample, the others copy it

    def remaining(self, seq_id: int, total_len: int) -> int:
        """Slots this sequence may still take: 1 before its first write or as a sharer that will copy."""
        if seq_id not in self.slot_of:
            return 1
        holders = self._holders[self.slot_of[seq_id]]
        return int(len(holders) > 1 and holders[-1] != seq_id)

    def free_units(self) -> int:
        return len(self._free)

    def capacity(self) -> int:
        return self.num_slots

    def step_view(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> GDNStepView:
        return GDNStepView(self.state, [self.slot_of[s] for s in seq_ids])
