"""A trainer pack cut for context parallelism (``parallel.cp``): this rank's rows and their :class:`IsoBatch`.

The caller packs the whole batch on every CP rank (as on every TP rank). :func:`shard_for_context` pads it to a
multiple of ``2 * CP`` rows (times TP under sequence parallelism, whose split follows) with one filler sequence
of token 0 at positions ``0 ..`` (a sequence of its own: no other row attends to it, and its rows are never
scored), then keeps this rank's zigzag chunks (``parallel.context``). The local batch carries the rows' true
positions (RoPE) and the :class:`~megatron_iso.parallel.context.ContextShard` the attention layers read.
"""

from __future__ import annotations

import torch

from megatron_iso.models.batch import IsoBatch, row_multiple
from megatron_iso.parallel.context import ContextShard, context_parallel_size


def context_row_multiple(config, size: int) -> int:
    """What a pack's row count is padded to under CP ``size``: ``2 * size`` chunks of equal length, each CP rank's
    rows then split evenly over TP under sequence parallelism."""
    return 2 * size * row_multiple(config)


def shard_for_context(input_ids: torch.Tensor, batch: IsoBatch, config) -> tuple[torch.Tensor, IsoBatch] | None:
    """This CP rank's ``input_ids [1, n]`` and batch of the whole pack ``input_ids [1, T]`` / ``batch``; None at
    CP 1. Only a trainer pack (no KV cache) can be split: the rollout engine runs CP 1."""
    from megatron.core import parallel_state

    size = context_parallel_size()
    if size == 1:
        return None
    if batch.case != "trainer_forward" or batch.uses_cache or batch.gdn_cache is not None:
        raise ValueError(f"context parallelism splits trainer packs only, got case={batch.case!r} with a cache")
    if batch.cp is not None:
        raise ValueError("this batch is already one context-parallel rank's share")
    ids = input_ids.reshape(-1)
    real = ids.numel()
    bounds = [int(c) for c in batch.cu_seqlens_q.tolist()]  # one host read per pack (the layout's plan)
    pad = -real % context_row_multiple(config, size)
    positions = batch.positions
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        positions = torch.cat([positions, torch.arange(pad, device=positions.device, dtype=positions.dtype)])
        bounds.append(real + pad)
    group = parallel_state.get_context_parallel_group()
    shard = ContextShard.build(bounds, real, group, size, parallel_state.get_context_parallel_rank(), ids.device)
    runs = shard.runs
    cu = torch.tensor(runs.cu, dtype=torch.int32).to(ids.device, non_blocking=True)
    longest = max(b - a for a, b in zip(runs.cu, runs.cu[1:], strict=False))
    local = IsoBatch(
        qkv_format="thd",
        cu_seqlens_q=cu,  # the local runs: each a piece of one sequence (attention reads ``cp``, not these)
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        positions=positions[shard.index],
        case="trainer_forward",
        max_position=None if batch.max_position is None else max(batch.max_position, pad - 1),
        static_shapes=batch.static_shapes,
        ids_checked_below=batch.ids_checked_below,
        cp=shard,
        routing=None if batch.routing is None else batch.routing.cut(shard.index, pad),
    )
    return ids[shard.index].unsqueeze(0), local
