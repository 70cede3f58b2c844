"""MoE routing and combine, torch reference path: every result is a function of its own token only.

- :func:`router_probs`: softmax over experts of fp32 router logits. max is exact, exp is the
  IEEE-composed ``iso_exp`` (same bits in vector and scalar lanes), the sum is the fixed tree.
- :func:`top_k_route`: the k largest probabilities, ties to the lowest expert index (a stable
  descending sort keeps equal scores in index order), returned in ascending expert index: that is
  the routing order in which a token's expert outputs are combined. Optional renormalisation
  (``norm_topk_prob``) divides by the tree sum of the chosen k.
- :func:`combine_routed`: ``sum_k w_k * y_k`` per token in routing order, fp32 products, fp32
  tree sum; nothing is scattered or accumulated into shared rows.

Elementwise ops and the fixed tree round each element once whatever the tensor's shape, so these
functions are batch invariant, and, because they never see another rank's tokens, EP invariant.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.ieee_math import iso_exp
from megatron_iso.ops.common.tree import tree_sum_dim


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim (experts) of ``logits [..., E]``."""
    if logits.dtype != torch.float32:
        raise TypeError(f"router logits must be fp32 (the router GEMM accumulates in fp32), got {logits.dtype}")
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    e = iso_exp(shifted)
    return e / tree_sum_dim(e, -1).unsqueeze(-1)


def top_k_route(probs: torch.Tensor, k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] fp32, experts [N, k] int64)`` with experts ascending in each row.

    Selection: probabilities sorted descending with a stable sort, so among equal scores the lower
    expert index wins. ``normalize`` divides the k weights by their tree sum (``norm_topk_prob``).
    """
    num_experts = probs.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"moe_router_topk={k} must be in [1, num_moe_experts={num_experts}]")
    chosen = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :k]
    return route_weights(probs, chosen, normalize=normalize)


def route_weights(probs: torch.Tensor, chosen: torch.Tensor, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts ascending)`` of the experts ``chosen`` per row (the top-k, or a replayed routing)."""
    experts = torch.sort(chosen, dim=-1).values
    weights = probs.gather(-1, experts)
    if normalize:
        weights = weights / tree_sum_dim(weights, -1).unsqueeze(-1)
    return weights, experts


def combine_routed(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 ``sum_k weights[n, k] * expert_out[n, k, :]`` with the fixed tree over k (routing order)."""
    if expert_out.dim() != 3 or weights.shape != expert_out.shape[:2]:
        raise ValueError(
            f"combine_routed: expert_out must be [N, k, H] and weights [N, k]; got {tuple(expert_out.shape)} "
            f"and {tuple(weights.shape)}"
        )
    return tree_sum_dim(expert_out.float() * weights.float().unsqueeze(-1), 1)
