"""The one scoring function: packed tokens -> per-token logprob and entropy of the next token.

The trainer's recompute and the rollout sampler both call :func:`token_scores`, so the logprob
recorded at rollout is computed by the same code (vocab-parallel, leaf-tree log-sum-exp, fp32,
temperature-scaled) as the logprob the trainer sees.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_iso.parallel.vocab import token_logprobs_and_entropy


def token_scores(
    logits: torch.Tensor, targets: torch.Tensor, config, *, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(logprob of targets, entropy)`` per row of vocab-parallel ``logits [T, V/tp]``."""
    group = parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    return token_logprobs_and_entropy(
        logits,
        targets,
        temperature=temperature,
        group=group,
        leaves=config.iso_leaves,
        profile=config.iso_profile,
    )


def score_sequences(
    model, input_ids: torch.Tensor, batch, *, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced scores of packed sequences: row t scores token t+1 of its own sequence.

    Returns ``(logprobs, entropy)`` of shape ``[T]``; the last position of every sequence has no
    next token and holds 0.
    """
    logits = model.forward_packed(input_ids, batch)
    ids = input_ids.reshape(-1)
    targets = torch.roll(ids, -1)
    logp, ent = token_scores(logits, targets, model.config, temperature=temperature)
    last = batch.cu_seqlens_q[1:].long() - 1
    keep = torch.ones_like(logp, dtype=torch.bool)
    keep[last] = False
    return torch.where(keep, logp, torch.zeros_like(logp)), torch.where(keep, ent, torch.zeros_like(ent))
