"""Gated DeltaNet op family: causal conv1d + SiLU, l2norm, gates, and the gated delta rule (CPR).

Dispatch as in ``ops.norm``: CPU+correctness = ``reference`` (CPR: one semantics for training,
prefill and decode), CUDA+correctness = ``megatron_iso.ops.gdn.gdn_triton`` (lazy, same signatures),
performance = ``native`` (chunked for training/prefill, recurrent for decode, as stock stacks).
Per-sequence state lives in :class:`~megatron_iso.ops.gdn.state_cache.GDNStateCache`.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.dispatch import select
from megatron_iso.ops.gdn import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.gdn.reference import DEFAULT_CHUNK, L2NORM_EPS
from megatron_iso.ops.gdn.state_cache import GDNLayerState, GDNStateCache

TRITON_MODULE = "megatron_iso.ops.gdn.gdn_triton"


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    profile: str = "correctness",
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over packed rows ``x [T, Cd]`` with ``weight [Cd, K]``; updates ``conv_state``."""
    fn = select("gdn_conv1d", x, profile, TRITON_MODULE)
    return fn(x, weight, cu_seqlens, conv_state=conv_state, slots=slots, starts=starts)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS, *, profile: str = "correctness") -> torch.Tensor:
    """fp32 ``x / sqrt(sum(x^2) + eps)`` over the last dim."""
    return select("gdn_l2norm", x, profile, TRITON_MODULE)(x, eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, profile: str = "correctness"
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(g, beta) = (-exp(A_log) * softplus(a + dt_bias), sigmoid(b))``."""
    return select("gdn_gates", a, profile, TRITON_MODULE)(a, b, A_log, dt_bias)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    state: GDNLayerState | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    profile: str = "correctness",
) -> torch.Tensor:
    """Gated delta rule over packed sequences (fp32 ``[T, Hv, Dv]``); see ``reference`` for the semantics."""
    fn = select("gated_delta_rule", q, profile, TRITON_MODULE)
    return fn(q, k, v, g, beta, cu_seqlens, scale=scale, chunk=chunk, state=state, slots=slots, starts=starts)


__all__ = [
    "DEFAULT_CHUNK",
    "GDNLayerState",
    "GDNStateCache",
    "causal_conv1d",
    "gated_delta_rule",
    "gdn_gates",
    "l2norm",
]
