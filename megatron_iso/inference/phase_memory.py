"""The rollout's device memory handed to the trainer between rollouts, and taken back for the next one.

A colocated engine keeps its KV pool (every attention layer's keys and values) and its GDN state slots allocated
for the whole run: at Qwen3-8B widths a 16 GB pool stays resident through the trainer's forward, backward and
Adam step, which is where the trainer's peak is. Stock colocated RL stacks release it between phases (vLLM's sleep
mode). Between two rollouts nothing in those tensors is needed: every sequence has finished, and the weight sync
that follows the optimizer step flushes the prefix cache and every recurrent state anyway (the contract's
invalidation rules). Nor are the serving copies of weights (the performance profile's stacked MoE expert
weights, ``models.moe_serving``), which a restore copies from the parameters again. So
:meth:`RolloutMemory.release` frees the tensors' storage (the tensor objects and their shapes stay: every view and
table of the caches stays valid) and :meth:`RolloutMemory.restore` allocates it again, zeroed as at construction.

Bits: a restored cache is the state of a freshly built engine's cache (zeros, no cached prefix), and a rollout after
a weight sync starts from exactly that state whether or not the memory was released: the next rollout's tokens and
logprobs do not change (tests/inference/test_phase_memory.py). CUDA graphs read the cache tensors' addresses, which a
new allocation may change: :meth:`RolloutMemory.restore` keeps the captured graphs when every tensor is back at its
address, and otherwise drops them (their static buffers stay; they are captured again on first use).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from megatron_iso.inference.engine import RolloutEngine
from megatron_iso.models.moe_serving import expert_stacks, refresh_expert_stacks


def cache_tensors(engine: RolloutEngine) -> list[torch.Tensor]:
    """Every tensor holding per-sequence decoding state: the KV pool's (with its recorded routing) and the GDN
    slots'."""
    out = [*engine.kv.k.values(), *engine.kv.v.values(), *([] if engine.kv.routes is None else [engine.kv.routes])]
    if engine.gdn is not None:
        for layer in engine.gdn.state.layers.values():
            out += [getattr(layer, f.name) for f in fields(layer) if isinstance(getattr(layer, f.name), torch.Tensor)]
    return out


def serving_copies(engine: RolloutEngine) -> list[torch.Tensor]:
    """The serving copies of weights the engine's layers keep beside the trainer's parameters: the performance
    profile's stacked MoE expert weights (``models.moe_serving.ExpertStack``), once built."""
    return [t for stack in expert_stacks(engine.model) for t in stack.tensors()]


class RolloutMemory:
    """Releases and restores one engine's cache storage (:func:`cache_tensors`) between rollouts."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._addresses: list[int] | None = None  # the cache tensors' addresses when released; None: resident

    @property
    def released(self) -> bool:
        return self._addresses is not None

    def release(self) -> int:
        """Free the cache tensors' storage; the bytes freed. The engine must be idle (no running sequence); its
        cached prefixes are forgotten."""
        engine = self.engine
        if engine.has_unfinished() or engine.kv.tables or (engine.gdn is not None and engine.gdn.slot_of):
            raise RuntimeError("RolloutMemory.release: the engine still has sequences; finish the rollout first")
        if self.released:
            return 0
        engine.kv.flush()  # its reusable prefixes point into the pool about to go; the GDN slots keep no prefixes
        tensors = cache_tensors(engine) + serving_copies(engine)
        self._addresses = [t.data_ptr() for t in tensors]
        freed = 0
        for t in tensors:
            storage = t.untyped_storage()
            freed += storage.nbytes()
            storage.resize_(0)
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the blocks back to the driver, for the trainer's allocations
        return freed

    def restore(self) -> None:
        """Allocate the released storage again, zeroed (a freshly built engine's state). Captured decode graphs are
        kept when every tensor came back at its old address, else dropped (captured again on first use)."""
        if not self.released:
            return
        tensors = cache_tensors(self.engine) + serving_copies(self.engine)
        for t in tensors:
            t.untyped_storage().resize_((t.storage_offset() + t.numel()) * t.element_size())
            t.zero_()
        refresh_expert_stacks(self.engine.model)  # the weights back into the serving copies
        moved = [t.data_ptr() for t in tensors] != self._addresses
        self._addresses = None
        if moved and self.engine.decode_graphs is not None:
            self.engine.decode_graphs.drop()


__all__ = ["RolloutMemory", "cache_tensors", "serving_copies"]
