"""The Gated DeltaNet family's backend signatures: what ``reference`` (CPR), ``native`` and the ``triton`` package
each answer."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_iso.ops.common.signatures import Signature
from megatron_iso.ops.gdn.state_cache import GDNLayerState


class CausalConv1d(Protocol):
    """op ``gdn_conv1d``: depthwise causal conv + SiLU over packed rows. x ``[T, Cd]``, weight ``[Cd, K]``,
    ``cu_seqlens [n+1]`` -> ``[T, Cd]`` in x's dtype; ``conv_state [slots, Cd, K-1]`` read and updated in place
    at ``slots``; ``starts[i]``: sequence i's position (0 = fresh)."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        conv_state: torch.Tensor | None = ...,
        slots: torch.Tensor | None = ...,
        starts: torch.Tensor | None = ...,
    ) -> torch.Tensor: ...


class L2Norm(Protocol):
    """op ``gdn_l2norm``: fp32 ``x / sqrt(sum(x^2) + eps)`` over the last dim; ``[..., D]`` -> ``[..., D]``."""

    def __call__(self, x: torch.Tensor, eps: float = ...) -> torch.Tensor: ...


class Gates(Protocol):
    """op ``gdn_gates``: a, b ``[T, Hv]``, A_log, dt_bias ``[Hv]`` -> fp32 ``(g, beta)``, each ``[T, Hv]``:
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""

    def __call__(
        self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class GatedDeltaRule(Protocol):
    """op ``gated_delta_rule``: q/k ``[T, Hk, Dk]`` (l2-normalised), v ``[T, Hv, Dv]``, g (log decay) / beta
    ``[T, Hv]``, ``cu_seqlens [n+1]`` -> fp32 ``[T, Hv, Dv]``. ``state``, ``slots``, ``starts``: the rollout's
    per-sequence recurrent state, updated in place (``starts[i] > 0`` continues slot ``slots[i]``)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        scale: float | None = ...,
        chunk: int = ...,
        state: GDNLayerState | None = ...,
        slots: torch.Tensor | None = ...,
        starts: torch.Tensor | None = ...,
    ) -> torch.Tensor: ...


SIGNATURES = (
    Signature("gdn_conv1d", CausalConv1d),
    Signature("gdn_l2norm", L2Norm),
    Signature("gdn_gates", Gates),
    # The GPU kernels also take the output form, the chain's dot precision and whether the forward keeps its state
    # pass for the backward (docs/GDN.md "Output forms"); the dispatch point passes them on that path only.
    Signature(
        "gated_delta_rule", GatedDeltaRule, extras={"gated_delta_rule.triton": ("dot_precision", "form", "keep_states")}
    ),
)
