"""The LM head and the scoring of its rows, chunked over rows: no [tokens, vocab] tensor of a whole batch.

Training scores tens of thousands of rows against a vocabulary of ~150k: the logits of a batch are
then tens of GB (bf16), their fp32 softmax as much again, and the backward of the plain formula another
copy. :func:`head_token_logprobs` runs the LM head and :func:`~megatron_iso.parallel.vocab_scoring.token_logprobs`
on one chunk of rows at a time and keeps only the rows' hidden states for the backward, which recomputes
each chunk's logits. Bits: a row's logits and its logprob depend on that row only (the GEMM and the
scoring are batch invariant), so the chunking changes no bit of the forward; the backward is the same
plain formula as :func:`token_logprobs`'s, chunk by chunk, with the weight gradient summed over chunks in
fp32 and rounded once (deterministic, not invariant).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_iso.ops.common.autograd import plain_grads
from megatron_iso.ops.gemm.reference import linear_backward

# Rows per chunk: this many logits elements at most (an fp32 copy of them is 1 GiB), rounded to 128 rows.
CHUNK_ELEMENTS = 1 << 28

Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [c, H], weight [V/C, H]) -> logits [c, V/C]
Score = Callable[[torch.Tensor, slice], torch.Tensor]  # (logits of the rows in slice, that slice) -> [c] fp32


def chunk_rows(vocab_local: int) -> int:
    """Rows per chunk for a vocab shard of ``vocab_local`` columns."""
    return max(128, (CHUNK_ELEMENTS // max(vocab_local, 1)) // 128 * 128)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, head, score, plain_score, rows, statistic):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.head, ctx.plain_score, ctx.rows = head, plain_score, rows
        with torch.no_grad():
            logp, stat = scored_chunks(x, weight, head, score, rows, statistic)
        if stat is None:
            stat = x.new_zeros(0, dtype=torch.float32)
        ctx.mark_non_differentiable(stat)
        return logp, stat

    @staticmethod
    def backward(ctx, grad, _grad_stat):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for c in _chunks(x.shape[0], ctx.rows):
            with torch.no_grad():
                logits = ctx.head(x[c], weight)
            g_logits, _ = plain_grads(ctx.plain_score, (logits, c), (True, False), grad[c])
            gx, gw = linear_backward(
                g_logits, x[c], weight, need_x=grad_x is not None, need_w=need_w, fp32_weight_grad=True
            )
            if grad_x is not None:
                grad_x[c] = gx
            if grad_w is not None:
                grad_w += gw
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _chunks(total: int, rows: int) -> list[slice]:
    return [slice(a, min(a + rows, total)) for a in range(0, total, rows)]


def scored_chunks(
    x: torch.Tensor, weight: torch.Tensor, head: Head, score: Score, rows: int, statistic: Score | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``score(head(x, weight))`` chunk by chunk (no autograd graph kept), concatenated over rows; and
    ``statistic`` of the same chunk logits (None without one)."""
    parts, stats = [], []
    for c in _chunks(x.shape[0], rows):
        logits = head(x[c], weight)
        parts.append(score(logits, c))
        if statistic is not None:
            stats.append(statistic(logits, c))
    empty = x.new_zeros(0, dtype=torch.float32)
    logp = torch.cat(parts) if parts else empty
    if statistic is None:
        return logp, None
    return logp, torch.cat(stats) if stats else empty


def head_token_logprobs(
    x: torch.Tensor,
    weight: torch.Tensor,
    head: Head,
    score: Score,
    plain_score: Score,
    statistic: Score | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``[T]``: ``score(head(x, weight))`` computed chunk by chunk over the rows of ``x [T, H]``; and
    ``statistic`` (e.g. the entropy) of each chunk's same logits, without gradient (None without one): one
    LM-head GEMM per chunk serves both.

    ``head`` is the LM head's own forward for some rows (invariant, rounded as the layer rounds);
    ``score(logits, rows)`` scores those rows (the invariant scoring function); ``plain_score`` is the
    differentiable formula the backward uses (as ``with_plain_backward`` does for the unchunked call).
    Differentiable in ``x`` and ``weight``.
    """
    rows = chunk_rows(weight.shape[0])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        logp, stat = _ChunkedHead.apply(x, weight, head, score, plain_score, rows, statistic)
        return logp, None if statistic is None else stat
    with torch.no_grad():
        return scored_chunks(x, weight, head, score, rows, statistic)
