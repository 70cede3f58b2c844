"""Training attention: the invariant forward, a plain deterministic backward.

The invariant reference writes its online-softmax state in place, which autograd cannot follow,
and the policy asks only that backward be deterministic (not invariant). So the forward runs
the invariant kernel and the backward recomputes the same attention with plain differentiable
fp32 torch ops (per sequence, fixed order) and differentiates that.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch


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


class _InvariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_fn, cu_seqlens, scale, q, k, v, gate):  # type: ignore[override]
        ctx.cu = [int(c) for c in cu_seqlens.tolist()]
        ctx.scale = scale
        ctx.has_gate = gate is not None
        ctx.save_for_backward(q, k, v, *([gate] if gate is not None else []))
        return forward_fn(q, k, v, cu_seqlens, softmax_scale=scale, gate=gate)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, *rest = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(True) for t in (q, k, v, *rest)]
            gate_in = inputs[3] if ctx.has_gate else None
            out = _plain_varlen(*inputs[:3], ctx.cu, ctx.scale, gate_in)
            grads = torch.autograd.grad(out, inputs, grad_out.float(), allow_unused=True)
        grads = [g.to(t.dtype) if g is not None else None for g, t in zip(grads, inputs, strict=True)]
        return None, None, None, grads[0], grads[1], grads[2], grads[3] if ctx.has_gate else None


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
    return _InvariantAttention.apply(forward_fn, cu_seqlens, scale, q, k, v, gate)
