"""Context parallelism (``parallel.cp``): the packed rows of one forward split over Megatron's CP group.

Layout ("zigzag", load-balanced): the packed length ``T`` is cut into ``2 * CP`` equal chunks and CP rank ``i``
holds chunks ``i`` and ``2 * CP - 1 - i``, in that order, so every rank has an early and a late chunk and the
causal attention work is even. Every row-wise op (embedding, norms, linears, MLP / MoE, RoPE from the rows'
true positions, LM head and logprob) runs on the local rows unchanged: batch invariance gives each row the bits
it has at CP 1. Attention all-gathers K and V over the CP group (:func:`gather_sequence_rows`: rank order, then
back to the packed order) and runs the local queries against the whole sequence's keys in the same fixed blocks
and order as at CP 1 (``ops.attention.segments``). The backward of that all-gather is a reduce-scatter whose sum
over ranks is ``ops.common.tree`` in rank order (``parallel.tree_collectives``): deterministic, not bitwise
CP-invariant (CP 1 sums the same terms in one pass). Gated DeltaNet layers run their own rows only and pass the
recurrence's state rank to rank in sequence order (``models.gdn_context``, over :func:`send_to` / :func:`recv_from`);
where the rule cannot carry a state they gather the whole pack the same way as K and V (``models.gdn``).

The scores come back to every CP rank (:func:`gather_scores`), so the loss is computed as at CP 1; its
gradient enters each rank's own rows times CP: Megatron's DDP averages gradients over data x context
parallel ranks (1 / (DP * CP)), while the CP ranks' gradients are parts of one sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist

from megatron_iso.ops.attention.segments import QueryRuns
from megatron_iso.parallel.tree_collectives import all_gather_list, gather_rows


def context_parallel_size() -> int:
    """The CP size of Megatron's parallel_state (1 when it is not initialised)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def zigzag_ranges(total: int, size: int, rank: int) -> list[tuple[int, int]]:
    """The packed rows ``[a, b)`` CP rank ``rank`` of ``size`` holds, in local order: chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size`` (``total`` must divide by ``2 * size``)."""
    if total % (2 * size):
        raise ValueError(f"context parallelism: {total} packed rows do not divide into 2 * cp = {2 * size} chunks")
    chunk = total // (2 * size)
    late = 2 * size - 1 - rank
    return [(rank * chunk, (rank + 1) * chunk), (late * chunk, (late + 1) * chunk)]


def query_runs(bounds: list[int], ranges: list[tuple[int, int]]) -> QueryRuns:
    """The local rows (``ranges`` of the pack whose sequences are ``bounds``, cu_seqlens as host ints) as runs
    of one sequence each, for ``ops.attention.segments``."""
    cu, starts, slots = [0], [], []
    slot_of: dict[int, int] = {}
    seq_first: list[int] = []
    seq_keys: list[int] = []
    for lo, hi in ranges:
        for s, (a, b) in enumerate(pairwise(bounds)):
            x, y = max(lo, a), min(hi, b)
            if x >= y:
                continue
            if s not in slot_of:
                slot_of[s] = len(seq_first)
                seq_first.append(a)
                seq_keys.append(0)
            slot = slot_of[s]
            cu.append(cu[-1] + y - x)
            starts.append(x - a)
            slots.append(slot)
            seq_keys[slot] = max(seq_keys[slot], y - a)
    return QueryRuns(cu, starts, slots, seq_first, seq_keys)


@dataclass(frozen=True)
class ContextShard:
    """One CP rank's part of a pack: which rows it holds and how its queries read the gathered keys.

    ``total``: the padded packed length (a multiple of ``2 * size``); ``real``: the caller's rows (the rest are
    a filler sequence of its own); ``index``: the packed row of each local row, in local order; ``packed_cu``: the
    padded pack's cu_seqlens (int32, on the rows' device), for layers that run the whole pack (Gated DeltaNet's
    fallback); ``bounds``: the same as host ints (the plan of Gated DeltaNet's state chain, ``models.gdn_context``)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    total: int
    real: int
    index: torch.Tensor
    runs: QueryRuns
    packed_cu: torch.Tensor
    bounds: tuple[int, ...]
    # Values derived from the shard that every layer of the pack's forward reads (the GDN state chain's plan and its
    # device cu_seqlens): built once per pack, not once per layer.
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: object, build: Callable[[], Any]) -> Any:
        """``build()`` once per shard and ``key`` (the key names everything the value depends on besides the shard)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @classmethod
    def build(cls, bounds: list[int], real: int, group, size: int, rank: int, device) -> ContextShard:
        ranges = zigzag_ranges(bounds[-1], size, rank)
        index = torch.cat([torch.arange(a, b) for a, b in ranges]).to(device, non_blocking=True)
        packed_cu = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
        runs = query_runs(bounds, ranges)
        return cls(group, size, rank, bounds[-1], real, index, runs, packed_cu, tuple(bounds))

    def to_packed_order(self, by_rank: torch.Tensor) -> torch.Tensor:
        """Rows gathered in rank order (rank r: its chunks r and 2CP-1-r) put back in packed order."""
        chunk = self.total // (2 * self.size)
        parts = by_rank.split(chunk)
        early = [parts[2 * r] for r in range(self.size)]
        late = [parts[2 * r + 1] for r in reversed(range(self.size))]
        return torch.cat(early + late)


def send_to(tensors: list[torch.Tensor], shard: ContextShard, peer: int) -> None:
    """Send ``tensors`` to CP rank ``peer``, in list order (point to point: a chain in sequence order, whose
    receiver knows the shapes from the same plan)."""
    dst = dist.get_global_rank(shard.group, peer) if shard.group is not None else peer
    for t in tensors:
        dist.send(t.contiguous(), dst=dst, group=shard.group)


def recv_from(
    like: list[tuple[tuple[int, ...], torch.dtype]], shard: ContextShard, peer: int, device
) -> list[torch.Tensor]:
    """Receive tensors of the given (shape, dtype)s from CP rank ``peer``, in the order :func:`send_to` sent them."""
    src = dist.get_global_rank(shard.group, peer) if shard.group is not None else peer
    out = []
    for shape, dtype in like:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src, group=shard.group)
        out.append(t)
    return out


def gather_sequence_rows(local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Every rank's rows of ``local [n, ...]`` in packed order ``[total, ...]``; the backward sums each row's
    gradient over the ranks with the tree in rank order (deterministic) and keeps this rank's rows."""
    return shard.to_packed_order(gather_rows(local, shard.group))


class _GatherScores(torch.autograd.Function):
    """Forward: every rank's per-row scores in packed order (the first ``real`` rows). Backward: this rank's rows
    of the gradient times CP (see the module docstring: DDP's 1 / (DP * CP) average)."""

    @staticmethod
    def forward(ctx, local, shard):  # type: ignore[override]
        ctx.shard = shard
        return shard.to_packed_order(torch.cat(all_gather_list(local, shard.group)))[: shard.real]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        shard = ctx.shard
        full = torch.cat([grad, grad.new_zeros(shard.total - shard.real, *grad.shape[1:])])
        return full[shard.index] * shard.size, None


def gather_scores(local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Per-row values of the local rows ``[n]`` as the whole pack's ``[real]``, on every CP rank."""
    return _GatherScores.apply(local, shard)
