"""Teacher-forced scores of packed sequences: a thin adapter over ``parallel.vocab_scoring``.

:func:`score_sequences` runs the model's packed forward and scores every row's next token with
``parallel.vocab_scoring.token_logprobs`` (and ``token_logprobs_and_entropy``), taking the TP group
from ``parallel_state`` and the leaves and profile from the model config. It adds no arithmetic of
its own beyond zeroing each sequence's last row.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

import megatron_iso.parallel.embedding  # noqa: F401  (registers the embedding op, as before the vocab split)
from megatron_iso.parallel.vocab_scoring import token_logprobs, token_logprobs_and_entropy


def _scoring_kwargs(config, temperature: float | torch.Tensor) -> dict:
    group = parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    return {"temperature": temperature, "group": group, "leaves": config.iso_leaves, "profile": config.iso_profile}


def score_sequences(
    model, input_ids: torch.Tensor, batch, *, temperature: float | torch.Tensor = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced scores of packed sequences: row t scores token t+1 of its own sequence.

    Returns ``(logprobs, entropy)`` of shape ``[T]`` (entropy None with ``with_entropy=False``, which
    skips its vocab pass); the last position of every sequence has no next token and holds 0.
    """
    logits = model.forward_packed(input_ids, batch)
    ids = input_ids.reshape(-1)
    targets = torch.roll(ids, -1)
    kwargs = _scoring_kwargs(model.config, temperature)
    if with_entropy:
        logp, ent = token_logprobs_and_entropy(logits, targets, **kwargs)
    else:
        logp, ent = token_logprobs(logits, targets, **kwargs), None
    last = batch.cu_seqlens_q[1:].long() - 1
    keep = torch.ones_like(logp, dtype=torch.bool)
    keep[last] = False

    def masked(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t, torch.zeros_like(t))

    return masked(logp), None if ent is None else masked(ent)
