"""The MoE family's backend signatures: the routed combine (the registered op) and the whole routing backend, a
module (``reference`` or ``native``) the dispatch point picks by profile."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_iso.ops.common.signatures import Signature


class CombineRouted(Protocol):
    """op ``moe_route_combine``: fp32 ``sum_k weights[n, k] * expert_out[n, k, :]``; expert_out ``[N, k, H]``,
    weights ``[N, k]`` -> ``[N, H]``."""

    def __call__(self, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


class RoutingBackend(Protocol):
    """A module holding the family's four functions (``reference`` and ``native`` both are one)."""

    def router_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 softmax over experts: logits ``[..., E]`` fp32 -> ``[..., E]``."""
        ...

    def top_k_route(self, probs: torch.Tensor, k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """probs ``[N, E]`` -> ``(weights [N, k] fp32, experts [N, k] int64)``."""
        ...

    def route_weights(
        self, probs: torch.Tensor, chosen: torch.Tensor, *, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of the experts ``chosen [N, k]`` (a replayed routing), as ``top_k_route`` returns them."""
        ...

    def combine_routed(self, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As :class:`CombineRouted`."""
        ...


SIGNATURES = (Signature("moe_route_combine", CombineRouted),)
