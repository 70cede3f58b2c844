"""The one scoring function: packed tokens -> per-token logprob and entropy of the next token.

The trainer's recompute and the rollout sampler both call :func:`token_logprobs` (directly, or
through :func:`token_scores` / :func:`score_sequences`, which add the entropy), so the logprob
recorded at rollout is computed by the same code (vocab-parallel, leaf-tree log-sum-exp, fp32,
temperature-scaled) as the logprob the trainer sees.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_iso.parallel import vocab


def _scoring_kwargs(config, temperature: float | torch.Tensor) -> dict:
    group = parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    return {"temperature": temperature, "group": group, "leaves": config.iso_leaves, "profile": config.iso_profile}


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    config,
    *,
    temperature: float | torch.Tensor = 1.0,
    ids_in_range: bool = False,
) -> torch.Tensor:
    """fp32 logprob of ``targets`` per row of vocab-parallel ``logits [T, V/tp]``: what the rollout
    records and the trainer recomputes. ``ids_in_range``: skip the targets' range check (a host read
    on a GPU) for ids the caller drew from this vocab; the arithmetic is the same."""
    return vocab.token_logprobs(logits, targets, ids_in_range=ids_in_range, **_scoring_kwargs(config, temperature))


def token_scores(
    logits: torch.Tensor, targets: torch.Tensor, config, *, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(logprob of targets, entropy)`` per row; the logprob bits equal :func:`token_logprobs`."""
    return vocab.token_logprobs_and_entropy(logits, targets, **_scoring_kwargs(config, temperature))


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
    if with_entropy:
        logp, ent = token_scores(logits, targets, model.config, temperature=temperature)
    else:
        logp, ent = token_logprobs(logits, targets, model.config, temperature=temperature), None
    last = batch.cu_seqlens_q[1:].long() - 1
    keep = torch.ones_like(logp, dtype=torch.bool)
    keep[last] = False

    def masked(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t, torch.zeros_like(t))

    return masked(logp), None if ent is None else masked(ent)
