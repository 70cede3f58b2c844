"""Lockstep of the ranks whose collectives run inside one engine forward.

With expert parallelism the EP group spans data-parallel replicas: each rank's engine decodes its own requests,
yet every MoE layer of every forward is an all-to-all over the whole EP group. A rank whose requests finish
first (a stop token, a shorter ``max_new_tokens``, fewer prefill chunks) must not leave the decode loop while a
peer still decodes: it would enter the trainer's collectives while the peer waits in the all-to-all (a hang, or
a timeout). So :meth:`RolloutEngine.generate` runs in lockstep over :func:`lockstep_group`: before each step the
ranks agree whether any of them still has work (:class:`~megatron_iso.parallel.watchdog.Agreement`, one int
all-reduced, MAX), and a rank without work runs an idle forward: padding rows only (one-token sequences at
position 0, keys in the KV cache's scratch block, GDN state in the scratch slot, logits dropped, nothing drawn),
so it takes its part in the step's collectives and touches no sequence's state. The loop ends on every rank at
the same step. Each lockstep step is exactly one forward on every rank (a step with nothing to launch, e.g. one
that only reports rejected requests, adds an idle forward).

Bits: a real row's result does not depend on which other rows (its own rank's or a peer's, padding included)
share the forward (batch and EP invariance of the correctness profile), and the sampler's draws are keyed by
(seed, request, sample, position), not by a step counter; so every real token and logprob is the one an
engine without idle steps (or a single rank) produces.

Which group: Megatron lays out the TP group and the EP group (expert TP 1) as contiguous blocks of ranks, so one
contains the other. The ranks of a TP group decode the same requests in lockstep by construction (scheduling is
a function of the requests), so an EP group inside a TP group needs no agreement; an EP group that spans several
TP groups (EP > TP) does, over the EP group. Other layouts are refused rather than left to hang.
"""

from __future__ import annotations

from typing import Any

import torch


def lockstep_group(config: Any) -> Any | None:
    """The process group whose ranks must step together for a model built with ``config`` (a Megatron
    ``TransformerConfig``), or None when none needs to (no MoE, EP 1, or an EP group inside the TP group)."""
    if not getattr(config, "num_moe_experts", None) or config.expert_model_parallel_size == 1:
        return None
    import torch.distributed as dist
    from megatron.core import parallel_state

    ep_group = parallel_state.get_expert_model_parallel_group()
    ep = set(dist.get_process_group_ranks(ep_group))
    tp = set(dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()))
    if ep <= tp:
        return None
    if tp <= ep:
        return ep_group
    raise ValueError(
        f"rollout lockstep: the expert-parallel group {sorted(ep)} and the tensor-parallel group {sorted(tp)} overlap "
        "without one containing the other; the engine cannot tell which ranks must decode in step"
    )


def lockstep_agreement(config: Any, device: torch.device) -> Any | None:
    """An :class:`~megatron_iso.parallel.watchdog.Agreement` over :func:`lockstep_group` (None without one)."""
    group = lockstep_group(config)
    if group is None:
        return None
    from megatron_iso.parallel.watchdog import Agreement

    return Agreement(group, "rollout lockstep", device)
