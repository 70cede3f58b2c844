"""Teacher-forced scores of packed sequences: a thin adapter over ``parallel.vocab_scoring``.

:func:`score_sequences` runs the model's packed forward and scores every row's next token with
``parallel.vocab_scoring.token_logprobs`` (and ``entropy``), taking the TP group from ``parallel_state``
and the leaves and profile from the model config. In the correctness profile the LM head and the
scoring run chunk by chunk over rows (``parallel.head_scoring``), so no [tokens, vocab] tensor of the
whole batch exists; the bits are those of the unchunked call. The performance profile chunks the same way with
the library GEMM and torch's log-softmax (the stock baseline at long sequences, where whole-batch fp32 logits
do not fit a GPU). It adds no arithmetic of its own beyond
zeroing each sequence's last row.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

import megatron_iso.parallel.embedding  # noqa: F401  (registers the embedding op, as before the vocab split)
from megatron_iso.models.batch import IsoBatch
from megatron_iso.models.context import shard_for_context
from megatron_iso.parallel.context import gather_scores
from megatron_iso.parallel.head_scoring import head_token_logprobs
from megatron_iso.parallel.vocab_scoring import entropy, token_logprobs
from megatron_iso.registry import Profile


def _scoring_kwargs(config, temperature: float | torch.Tensor) -> dict:
    group = parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    return {"temperature": temperature, "group": group, "leaves": config.iso_leaves, "profile": config.iso_profile}


def _for_rows(kwargs: dict, index: torch.Tensor | slice, total: int) -> dict:
    """Scoring kwargs for the rows ``index`` of ``total``: a per-row temperature (``[total, ...]``) narrowed to
    them, a scalar one kept."""
    t = kwargs["temperature"]
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == total:
        return kwargs | {"temperature": t[index]}
    return kwargs


def score_sequences(
    model,
    input_ids: torch.Tensor,
    batch,
    *,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced scores of packed sequences: row t scores token t+1 of its own sequence.

    Returns ``(logprobs, entropy)`` of shape ``[T]`` (entropy None with ``with_entropy=False``, which
    skips its vocab pass); the last position of every sequence has no next token and holds 0.
    ``rows`` (indices into T, on the model's device): score only these rows, the others hold 0. A row's
    scores do not depend on which other rows are scored; the correctness profile then runs the LM head on
    those rows only (a trainer needs the response rows, not the prompt's).
    """
    ids = input_ids.reshape(-1)
    targets = torch.roll(ids, -1)
    kwargs = _scoring_kwargs(model.config, temperature)
    # Ids pack checked on the host (IsoBatch.ids_checked_below) need no range check, a host read per chunk on a GPU.
    checked = getattr(batch, "ids_checked_below", None)
    ids_in_range = checked is not None and checked <= model.config.vocab_size
    sharded = shard_for_context(input_ids, batch, model.config) if isinstance(batch, IsoBatch) else None
    if sharded is not None:  # context parallelism: this rank's rows, scores of the whole pack gathered
        logp, ent = _score_context_shard(model, *sharded, targets, kwargs, with_entropy, rows, ids_in_range)
    else:
        if rows is not None:
            kwargs, targets = _for_rows(kwargs, rows, ids.numel()), targets[rows]
        logp, ent = _score_in_chunks(model, input_ids, batch, targets, kwargs, with_entropy, rows, ids_in_range)
        if rows is not None:
            logp = logp.new_zeros(ids.numel()).index_copy(0, rows, logp)
            ent = None if ent is None else ent.new_zeros(ids.numel()).index_copy(0, rows, ent)
    last = batch.cu_seqlens_q[1:].long() - 1
    keep = torch.ones_like(logp, dtype=torch.bool)
    keep[last] = False

    def masked(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t, torch.zeros_like(t))

    return masked(logp), None if ent is None else masked(ent)


def _score_context_shard(model, local_ids, local, targets, kwargs, with_entropy, rows, ids_in_range):
    """:func:`score_sequences` on this CP rank's rows (``local``: ``models.context``), the whole pack's scores
    gathered on every CP rank (``parallel.context.gather_scores``). A row's scores are those of CP 1: the same
    row-wise ops and the same attention bits."""
    shard = local.cp
    real = shard.real
    pad = shard.total - real
    index = shard.index

    def padded(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)]) if pad else t

    t = kwargs["temperature"]
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == real:  # per-row: the filler rows' is 1
        kwargs = kwargs | {"temperature": padded(t, 1.0)[index]}
    targets = padded(targets, 0)[index]
    local_rows = None
    if rows is not None:
        chosen = torch.zeros(shard.total, dtype=torch.bool, device=rows.device)
        chosen[rows] = True
        local_rows = chosen[index].nonzero()[:, 0]
        kwargs, targets = _for_rows(kwargs, local_rows, index.numel()), targets[local_rows]
    logp, ent = _score_in_chunks(model, local_ids, local, targets, kwargs, with_entropy, local_rows, ids_in_range)
    if local_rows is not None:
        logp = logp.new_zeros(index.numel()).index_copy(0, local_rows, logp)
        ent = None if ent is None else ent.new_zeros(index.numel()).index_copy(0, local_rows, ent)
    return gather_scores(logp, shard), None if ent is None else gather_scores(ent.detach(), shard)


def _stock_head_input(head, hidden: torch.Tensor) -> torch.Tensor:
    """What Megatron's ColumnParallelLinear does to its input: gather sequence-parallel rows, else attach the TP
    group's gradient all-reduce."""
    if head.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=head.tp_group)
    return copy_to_tensor_model_parallel_region(hidden, group=head.tp_group)


def _score_in_chunks(model, input_ids, batch, targets, kwargs, with_entropy, rows, ids_in_range):
    """The LM head and scoring, a chunk of rows at a time (``ids_in_range``: the targets are known to be in the
    vocab, no chunk checks them). The correctness profile runs the invariant head (``output_layer.local_output``)
    and scoring; the performance profile the library GEMM and torch's log-softmax per chunk, as stock trainers'
    chunked logprob does: neither holds [tokens, vocab] logits of the whole batch."""
    head = model.output_layer
    native = model.config.iso_profile == Profile.PERFORMANCE
    hidden = model.forward_hidden(input_ids, batch)
    x = _stock_head_input(head, hidden) if native else head.local_input(hidden)
    x = x if rows is None else x[rows]
    weight = model.output_weight()
    total = x.shape[0]

    def logits_of(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if native:
            return torch.nn.functional.linear(rows, w)
        return head.local_output(rows, w)[0]

    def for_rows(c: slice) -> dict:
        return _for_rows(kwargs, c, total)

    def score(logits: torch.Tensor, c: slice) -> torch.Tensor:
        return token_logprobs(logits, targets[c], ids_in_range=ids_in_range, **for_rows(c))

    def plain(logits: torch.Tensor, c: slice) -> torch.Tensor:
        return token_logprobs(logits, targets[c], **(for_rows(c) | {"profile": Profile.PERFORMANCE}))

    # The entropy is a statistic (no gradient) of the same chunk logits: no second LM-head pass.
    stat = (lambda lg, c: entropy(lg, **for_rows(c))) if with_entropy else None
    return head_token_logprobs(x, weight, logits_of, score, plain, stat)
