"""Vocab-parallel embedding and THE scoring function (token logprob / entropy / log-softmax).

``token_logprobs`` is the one function both the trainer and the rollout sampler call to turn
logits into the logprob of a chosen token, so the two sides can only differ if their logits do.

Logits are Megatron's vocab-parallel output: on each of the C ranks of ``group`` the contiguous
shard [..., V/C] (rank i holds ids [iV/C, (i+1)V/C)). ``group=None`` means no vocab parallelism:
the tensor holds the whole vocab. The reduction is the leaf tree of ``ops.logprob.reference``;
the cross-rank steps move data and finish the same tree, so results are independent of C.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import VocabParallelEmbedding

from megatron_iso.contract.registry import OpImpl, register
from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.gemm.reference import DEFAULT_LEAVES
from megatron_iso.ops.logprob import LocalShards, vocab_scores
from megatron_iso.parallel.tree_collectives import (
    Group,
    _size,
    all_gather_list,
    gather_along,
    split_along,
    tree_all_reduce,
)


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
    profile: str = "correctness",
    ids_in_range: bool = False,
) -> torch.Tensor:
    """fp32 ``log softmax(logits.float() / temperature)[target]`` per row. Differentiable.

    logits: [..., V/C] this rank's vocab shard (full vocab if ``group`` is None or of size 1);
    target_ids: [...] global token ids; temperature: > 0, float or tensor broadcasting as [..., 1];
    leaves: vocab leaves G (power of two, >= C, divides V); valid_vocab: ids >= it are padding.
    In the correctness profile the gradient is the native formula's (deterministic, see
    ``ops/autograd.py``), so the backward never stores the leaf-tree intermediates.
    ``ids_in_range``: the caller guarantees the ids are in the vocab (the rollout's own samples): the
    range check, a host read on a GPU, is skipped.
    """

    def score(profile_: str):
        return lambda lg: _scores(lg, group, temperature, leaves, valid_vocab, profile_).token_logprobs(
            target_ids, ids_in_range=ids_in_range
        )

    if profile == "correctness":
        return with_plain_backward(score("correctness"), score("performance"), logits)
    return score(profile)(logits)


def entropy(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: Group = None,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
    profile: str = "correctness",
) -> torch.Tensor:
    """fp32 entropy of ``softmax(logits / temperature)`` per row (same arguments as token_logprobs)."""
    return _scores(logits, group, temperature, leaves, valid_vocab, profile).entropy()


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: Group = None,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
    profile: str = "correctness",
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
    profile: str = "correctness",
) -> torch.Tensor:
    """fp32 log-softmax of this rank's vocab shard [..., V/C] (normalised over the whole vocab)."""
    return _scores(logits, group, temperature, leaves, valid_vocab, profile).log_softmax().squeeze(0)


class IsoVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding whose cross-rank combine is a selection, not a sum.

    Exactly one rank owns each token id; stock Megatron all-reduces one row among zeros, which is
    exact except that -0.0 + 0.0 = +0.0 (TP=1 keeps -0.0, TP>1 does not: different bits). Here
    every rank gathers all ranks' lookups and keeps the owner's row: no arithmetic, so the
    result is the weight row bit for bit at every TP. With sequence parallel
    (``reduce_scatter_embeddings``) each rank then keeps its own sequence block (transport).
    ``config.iso_profile == "performance"`` runs the stock forward.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method, config, **kwargs) -> None:
        super().__init__(num_embeddings, embedding_dim, init_method=init_method, config=config, **kwargs)
        self.iso_profile = getattr(config, "iso_profile", "correctness")

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.iso_profile == "performance":
            return super().forward(input_)
        c = self.tp_group.size() if self.tp_group is not None else 1
        if c == 1:
            out = self.weight[input_] if self.deterministic_mode else torch.nn.functional.embedding(input_, self.weight)
        else:
            owner = (input_ // self.num_embeddings_per_partition).clamp(0, c - 1)
            local = (input_ - self.vocab_start_index).clamp(0, self.num_embeddings_per_partition - 1)
            mine = self.weight[local] if self.deterministic_mode else torch.nn.functional.embedding(local, self.weight)
            stacked = gather_along(mine.unsqueeze(0), self.tp_group, dim=0)  # [C, ..., H]
            idx = owner.unsqueeze(0).unsqueeze(-1).expand(1, *mine.shape)
            out = stacked.gather(0, idx).squeeze(0)
        if self.reduce_scatter_embeddings:
            # [b, s, h] -> [s, b, h], then this rank's sequence block (Megatron's SP layout).
            out = split_along(out.transpose(0, 1).contiguous(), self.tp_group, dim=0)
        return out


def _probe_embedding() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    table = torch.randn(32, 8, generator=g).bfloat16()
    table[3, 1] = -0.0
    return {"bf16": table[torch.tensor([[3, 0, 31], [7, 3, 3]])]}


for _device in ("cpu", "cuda"):
    register(
        OpImpl(
            op="embedding",
            impl_id="vocab_embedding.select",
            version="1",
            device_class=_device,
            profile="correctness",
            fn=IsoVocabParallelEmbedding,
            constants={"combine": "all_gather_select_owner"},
            probe=_probe_embedding,
        )
    )
    register(
        OpImpl(
            op="embedding",
            impl_id="vocab_embedding.native",
            version="1",
            device_class=_device,
            profile="performance",
            fn=VocabParallelEmbedding,
            constants={"combine": "backend_all_reduce_sum"},
        )
    )

__all__ = [
    "GroupComm",
    "IsoVocabParallelEmbedding",
    "all_gather_list",
    "entropy",
    "log_softmax",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
