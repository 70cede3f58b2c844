"""Training attention: the invariant forward, and as the plain backward formula (see
``ops/autograd.py``) causal GQA attention in differentiable fp32 torch ops, per sequence."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from megatron_iso.ops.autograd import with_plain_backward


def _plain_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu_seqlens):
        qs = q[a:b].float().transpose(0, 1)  # [H, n, D]
        ks = k[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        outs.append((probs @ vs).transpose(0, 1))
    out = torch.cat(outs)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out


def attention_varlen_trainable(
    forward_fn: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    """``forward_fn``'s result (bits unchanged) with a deterministic plain-attention backward."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    bounds = [int(c) for c in cu_seqlens.tolist()]

    def invariant(q, k, v, gate):
        return forward_fn(q, k, v, cu_seqlens, softmax_scale=scale, gate=gate)

    def plain(q, k, v, gate):
        return _plain_varlen(q, k, v, bounds, scale, gate)

    return with_plain_backward(invariant, plain, q, k, v, gate)
