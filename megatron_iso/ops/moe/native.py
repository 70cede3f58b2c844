"""MoE routing and combine as stock stacks compute them (library softmax/top-k, library sum).

Megatron's own router and dispatcher serve the performance profile in the model; these functions
are their op-level counterparts for probes and the mismatch baseline.
"""

from __future__ import annotations

import torch


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1)


def top_k_route(probs: torch.Tensor, k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_weights(probs: torch.Tensor, chosen: torch.Tensor, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights = probs.gather(-1, chosen)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def combine_routed(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (expert_out.float() * weights.float().unsqueeze(-1)).sum(dim=1)
