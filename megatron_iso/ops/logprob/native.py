"""Native log-softmax family: what stock stacks do (torch.log_softmax over the full vocab).

The library picks the reduction order (vectorised, blocked, thread split), which can depend on
the vocab length and the launch; used by the performance profile and as the mismatch baseline.
"""

from __future__ import annotations

import torch


def log_softmax_native(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """fp32 ``log_softmax(logits.float() / temperature)`` over the last (full vocab) dim."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def token_logprobs_native(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """fp32 log-probability of each row's target over the full vocab."""
    logp = log_softmax_native(logits, temperature)
    return logp.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)


def entropy_native(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """fp32 entropy over the full vocab (torch's own sum)."""
    logp = log_softmax_native(logits, temperature)
    return -(logp.exp() * logp).nan_to_num(0.0).sum(-1)


class NativeScores:
    """Same interface as ``reference.VocabScores``; gathers the vocab and uses torch.log_softmax."""

    def __init__(self, logits, comm, *, temperature=1.0, leaves=None, valid_vocab=None) -> None:
        from megatron_iso.ops.logprob.reference import mask_padding

        del leaves  # the library picks its own order
        self.comm, self.r, self.shard = comm, logits.shape[0], logits.shape[-1]
        full = comm.gather_vocab(logits).float().unsqueeze(0)
        full = mask_padding(full, 0, full.shape[-1], valid_vocab).squeeze(0)
        self.full_logp = log_softmax_native(full, temperature)

    def log_softmax(self) -> torch.Tensor:
        first = self.comm.first_rank * self.shard
        return (
            self.full_logp[..., first : first + self.r * self.shard].unflatten(-1, (self.r, self.shard)).movedim(-2, 0)
        )

    def token_logprobs(self, target_ids: torch.Tensor, *, ids_in_range: bool = False) -> torch.Tensor:
        del ids_in_range  # no check to skip: gather itself refuses an id outside the vocab
        return self.full_logp.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> torch.Tensor:
        logp = self.full_logp
        return -torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp.exp() * logp).sum(-1)
