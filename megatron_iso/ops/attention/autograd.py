"""Training attention: the invariant forward, and a deterministic backward.

On CUDA the backward is ``backward_triton.attention_backward`` (FlashAttention-2 style kernels, no
atomics). Elsewhere, and as the readable reference those kernels are tested against, it is the plain
formula (see ``ops/common/autograd.py``): causal GQA attention in differentiable fp32 torch ops, sequences
batched with padding (one launch sequence per group of sequences instead of per sequence)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from megatron_iso.ops.attention.reference import _bounds
from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.common.dispatch import import_triton_module

BACKWARD_TRITON_MODULE = "megatron_iso.ops.attention.backward_triton"

# Padded score tensors of one batched call stay below this many bytes; more sequences go in several calls.
_SCORES_BYTES = 1 << 30


def padded_index(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For consecutive packed sequences of ``lens``: ``rows [B, L]`` (packed row of each padded slot; padding
    points at row ``sum(lens)``, an appended zero row) and ``valid [B, L]`` (real slots)."""
    lens_t = torch.tensor(lens, device=device)
    starts = torch.cumsum(lens_t, 0) - lens_t
    pos = torch.arange(max(lens), device=device)
    valid = pos[None, :] < lens_t[:, None]
    rows = torch.where(valid, starts[:, None] + pos[None, :], torch.full_like(valid, sum(lens), dtype=torch.long))
    return rows, valid


def _plain_padded(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    """Causal GQA attention of consecutive packed sequences as one padded batch: ``[sum(lens), Hq, D]`` fp32.

    Rows are gathered into ``[B, L, H, D]`` through an index whose padding points at an appended zero row,
    so every real row is read once and its gradient is a plain copy (no accumulation into shared rows).
    """
    longest = max(lens)
    dev = q.device
    rows, valid = padded_index(lens, dev)
    group = q.shape[1] // k.shape[1]

    def padded(t: torch.Tensor) -> torch.Tensor:  # [total, H, D] -> [B, H, L, D] fp32
        ext = torch.cat([t.float(), t.new_zeros(1, *t.shape[1:], dtype=torch.float32)])
        return ext[rows].transpose(1, 2)

    qp = padded(q)
    kp = padded(k).repeat_interleave(group, dim=1)
    vp = padded(v).repeat_interleave(group, dim=1)
    scores = (qp @ kp.transpose(-1, -2)) * scale  # [B, H, L, L]
    allowed = torch.ones(longest, longest, dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    out = (probs @ vp).transpose(1, 2)  # [B, L, H, D]
    return out[valid]  # packed order: sequence by sequence, position by position


def _plain_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    """Causal GQA attention over packed sequences in differentiable fp32 torch ops: sequences batched
    (padded) in groups whose score tensors fit ``_SCORES_BYTES``. Deterministic; not invariant (backward only)."""
    heads = q.shape[1]
    lens = [b - a for a, b in itertools.pairwise(cu_seqlens)]
    outs, group, first = [], [], cu_seqlens[0]

    def flush() -> None:
        nonlocal first
        if group:
            size = sum(group)
            outs.append(_plain_padded(q[first : first + size], k[first : first + size], v[first : first + size],
                                      group, scale))  # fmt: skip
            first += size
            group.clear()

    for n in lens:
        if n == 0:
            continue
        longest = max([n, *group])
        if group and (len(group) + 1) * heads * longest * longest * 4 > _SCORES_BYTES:
            flush()
        group.append(n)
    flush()
    out = torch.cat(outs) if outs else q.new_zeros(0, *q.shape[1:], dtype=torch.float32)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out


class _KernelBackward(torch.autograd.Function):
    """The invariant forward; the backward by the Triton kernels (inputs saved, statistics recomputed)."""

    @staticmethod
    def forward(ctx, invariant, q, k, v, gate, cu_seqlens, max_len, scale):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, gate, cu_seqlens)
        ctx.max_len, ctx.scale = max_len, scale
        with torch.no_grad():
            return invariant(q, k, v, gate)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, gate, cu_seqlens = ctx.saved_tensors
        kernels = import_triton_module(BACKWARD_TRITON_MODULE, "the attention backward on cuda")
        dq, dk, dv, dgate = kernels.attention_backward(q, k, v, grad_out, cu_seqlens, ctx.max_len, ctx.scale, gate)
        return None, dq, dk, dv, dgate, None, None, None


def kernel_backward_serves(q: torch.Tensor) -> bool:
    """Whether the Triton backward takes ``q``: on CUDA, head dim a power of two >= 16."""
    d = q.shape[-1]
    return q.is_cuda and d >= 16 and not d & (d - 1)


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
    bounds = _bounds(cu_seqlens)

    def invariant(q, k, v, gate):
        return forward_fn(q, k, v, cu_seqlens, softmax_scale=scale, gate=gate)

    if kernel_backward_serves(q):
        max_len = max((b - a for a, b in itertools.pairwise(bounds)), default=0)
        return _KernelBackward.apply(invariant, q, k, v, gate, cu_seqlens, max_len, scale)

    def plain(q, k, v, gate):
        return _plain_varlen(q, k, v, bounds, scale, gate)

    return with_plain_backward(invariant, plain, q, k, v, gate)
