"""The rollout's MoE routing, recorded for routing replay (``rl.routing_replay``, ``models.routing``).

Where it lives: beside the keys, in the paged KV cache (``PagedKVCache.routes``, ``[blocks, block_size, layers,
k]``). Each MoE layer of a prefill or decode step hands its top-k experts to the step (``StepState.record_routing``),
which writes them all at its end at the rows the step's keys go to (``PagedStepView.write_idx``), on the device: no
host read, and a captured decode step records inside its graph.
So a token's routing follows its keys everywhere they go: a prompt prefilled once and forked into ``n`` samples,
a prefix-cache hit on another request's blocks, a shared partial block copied on write. When a sample finishes,
:func:`sequence_routing` gathers the routing of every position it ran through the model (prompt and response but
the last token, which no forward took as input), and the engine puts it on the sample
(``SampleOutput.routing``): it travels with the rollout's outputs to the trainer, no side file.

Not under sequence parallelism (each TP rank routes a share of a step's rows; a rank's pool would hold only its
share): :func:`enable_routing_record` refuses it.
"""

from __future__ import annotations

import torch

from megatron_iso.inference.kv_blocks import PagedKVCache


def enable_routing_record(kv: PagedKVCache, config) -> None:
    """Give ``kv`` its routing pool for the MoE model of Megatron ``config`` (every layer's top-k; the pool's
    integer type holds every expert index). Small beside the KV pool: ``layers * k`` integers per token."""
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    if not experts:
        raise ValueError(
            "rl.routing_replay: the model has no MoE layers (model.num_experts is unset); nothing to record"
        )
    if getattr(config, "sequence_parallel", False) and config.tensor_model_parallel_size > 1:
        raise ValueError(
            "rl.routing_replay: the rollout records routing without sequence parallelism; set parallel.sp=false"
        )
    dtype = torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32
    device = next(iter(kv.k.values())).device if kv.k else torch.device("cpu")
    shape = (kv.num_blocks, kv.block_size, int(config.num_layers), int(config.moe_router_topk))
    kv.routes = torch.full(shape, -1, dtype=dtype, device=device)


def _check_rows(experts: torch.Tensor, write_idx: torch.Tensor) -> None:
    if experts.shape[0] != write_idx.numel():
        raise ValueError(
            f"routing record: the router routed {experts.shape[0]} rows, the step writes {write_idx.numel()} keys "
            "(sequence parallelism is not supported)"
        )


def record_step_routing(routes: torch.Tensor, write_idx: torch.Tensor, layer: int, experts: torch.Tensor) -> None:
    """Layer ``layer``'s experts ``[T, k]`` of a step's ``T`` rows, written at the rows their keys go to."""
    _check_rows(experts, write_idx)
    routes.view(-1, *routes.shape[2:])[write_idx, layer] = experts.to(routes.dtype)


def record_step_routing_all(routes: torch.Tensor, write_idx: torch.Tensor, experts: dict[int, torch.Tensor]) -> None:
    """Every MoE layer's experts of one step (``{layer: [T, k]}``), written at the end of the step: layers that
    form one contiguous run in one stacked write (a decode step records all its layers in three launches, not two
    per layer), any others one by one."""
    layers = sorted(experts)
    for layer in layers:
        _check_rows(experts[layer], write_idx)
    if layers and layers == list(range(layers[0], layers[0] + len(layers))):
        block = torch.stack([experts[i] for i in layers], dim=1).to(routes.dtype)  # [T, layers, k]
        routes.view(-1, *routes.shape[2:])[write_idx, layers[0] : layers[-1] + 1] = block
        return
    for layer in layers:
        record_step_routing(routes, write_idx, layer, experts[layer])


def sequence_routing(kv: PagedKVCache, seq_id: int, length: int) -> torch.Tensor:
    """``[length, layers, k]`` int64: the recorded experts of positions ``0 .. length - 1`` of sequence
    ``seq_id`` (still holding its blocks), on the cache's device (no host read)."""
    bs, table = kv.block_size, kv.tables[seq_id]
    if length > kv.lengths[seq_id]:
        raise ValueError(f"sequence {seq_id} holds {kv.lengths[seq_id]} tokens; asked for the routing of {length}")
    pos = torch.arange(length)
    rows = torch.tensor(table, dtype=torch.int64)[pos // bs] * bs + pos % bs
    flat = kv.routes.view(-1, *kv.routes.shape[2:])
    return flat[rows.to(flat.device, non_blocking=True)].long()
