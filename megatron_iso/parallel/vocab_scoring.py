"""Vocab-parallel scoring: token logprob, entropy and log-softmax of logits sharded over a TP group.

:func:`token_logprobs` is the scoring function; :func:`entropy`, :func:`token_logprobs_and_entropy`
and :func:`log_softmax` are the same reduction queried for other row statistics. The model-level
adapter ``models.scoring.score_sequences`` calls these with the model config's leaves and profile.

Logits are Megatron's vocab-parallel output: on each of the C ranks of ``group`` the contiguous
shard [..., V/C] (rank i holds ids [iV/C, (i+1)V/C)). ``group=None`` means no vocab parallelism:
the tensor holds the whole vocab. The reduction is the leaf tree of ``ops.logprob.reference``,
picked per device and profile by ``ops.logprob.vocab_scores``; the cross-rank steps
(:class:`GroupComm`) move data and finish the same tree, so results are independent of C.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.gemm.reference import DEFAULT_LEAVES
from megatron_iso.ops.logprob import LocalShards, vocab_scores
from megatron_iso.ops.logprob.entropy import row_entropy
from megatron_iso.parallel.tree_collectives import Group, _rank, _size, all_gather_list, gather_along, tree_all_reduce
from megatron_iso.registry import Profile


class GroupComm:
    """Cross-rank steps over a process group; this rank is the one entry of the rank axis."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.first_rank = dist.get_rank(group)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        out = t.squeeze(0).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)  # max is exact in any order
        return out

    def tree(self, t: torch.Tensor) -> torch.Tensor:
        return tree_all_reduce(t.squeeze(0), self.group)

    def pick(self, t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        # Gather every rank's candidate and select the owner's: no arithmetic, exact (even -0.0).
        stacked = torch.stack(_gather_replicated(t.squeeze(0), self.group), dim=0)
        return stacked.gather(0, owner.unsqueeze(0)).squeeze(0)

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor:
        return gather_along(t.squeeze(0), self.group, dim=-1)


def _gather_replicated(t: torch.Tensor, group: Group) -> list[torch.Tensor]:
    # The stacked result feeds a replicated output, so backward is "own slot" (gather_along).
    return list(gather_along(t.unsqueeze(0), group, dim=0).unbind(0))


def _comm(group: Group):
    return GroupComm(group) if group is not None and _size(group) > 1 else LocalShards(1)


def _scores(logits, group, temperature, leaves, valid_vocab, profile):
    return vocab_scores(
        logits.unsqueeze(0),
        _comm(group),
        temperature=temperature,
        leaves=leaves,
        valid_vocab=valid_vocab,
        profile=profile,
    )


def token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: Group = None,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
    profile: str = Profile.CORRECTNESS,
    ids_in_range: bool = False,
) -> torch.Tensor:
    """fp32 ``log softmax(logits.float() / temperature)[target]`` per row. Differentiable.

    The function both the rollout and the trainer call: the engine records this for each drawn
    token, the trainer recomputes it (``models.scoring.score_sequences``), so the two sides can only
    differ if their logits do.

    logits: [..., V/C] this rank's vocab shard (full vocab if ``group`` is None or of size 1);
    target_ids: [...] global token ids; temperature: > 0, float or tensor broadcasting as [..., 1];
    leaves: vocab leaves G (power of two, >= C, divides V); valid_vocab: ids >= it are padding.
    In the correctness profile the gradient is the native formula's (deterministic, see
    ``ops/common/autograd.py``), so the backward never stores the leaf-tree intermediates.
    ``ids_in_range``: the caller guarantees the ids are in the vocab (the rollout's own samples; the trainer's ids,
    checked on the host by ``models.batch.pack``): the range check, a host read on a GPU, is skipped.
    """

    def score(profile_: str):
        return lambda lg: _scores(lg, group, temperature, leaves, valid_vocab, profile_).token_logprobs(
            target_ids, ids_in_range=ids_in_range
        )

    if profile == Profile.CORRECTNESS:
        return with_plain_backward(score(Profile.CORRECTNESS), score(Profile.PERFORMANCE), logits)
    return score(profile)(logits)


def entropy(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: Group = None,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """fp32 entropy of ``softmax(logits / temperature)`` per row (same arguments as token_logprobs). A logged
    statistic: on CUDA (correctness profile) one pass of ``ops.logprob.entropy`` over the logits, elsewhere the
    leaf tree's; both the same bits for any batch and any TP size."""
    if profile == Profile.CORRECTNESS and logits.is_cuda:
        world = _size(group) if group is not None else 1
        return row_entropy(
            logits,
            temperature=temperature,
            leaves=leaves,
            world=world,
            rank=_rank(group) if world > 1 else 0,
            valid_vocab=valid_vocab,
            gather=(lambda parts: torch.cat(all_gather_list(parts, group), dim=1)) if world > 1 else None,
        )
    return _scores(logits, group, temperature, leaves, valid_vocab, profile).entropy()


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: Group = None,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
    profile: str = Profile.CORRECTNESS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both; bits equal to the separate calls. The entropy is a statistic here: no gradient."""
    kwargs = {"temperature": temperature, "group": group, "leaves": leaves, "valid_vocab": valid_vocab}
    logp = token_logprobs(logits, target_ids, profile=profile, **kwargs)
    with torch.no_grad():
        return logp, entropy(logits, profile=profile, **kwargs)


def log_softmax(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: Group = None,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """fp32 log-softmax of this rank's vocab shard [..., V/C] (normalised over the whole vocab)."""
    return _scores(logits, group, temperature, leaves, valid_vocab, profile).log_softmax().squeeze(0)


__all__ = [
    "GroupComm",
    "entropy",
    "log_softmax",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
