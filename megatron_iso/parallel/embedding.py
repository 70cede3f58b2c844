"""Vocab-parallel embedding whose TP combine is a selection (registered as the ``embedding`` op)."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding

from megatron_iso.parallel.layer_config import iso_config
from megatron_iso.parallel.tree_collectives import gather_along, split_along
from megatron_iso.registry import Profile, register_per_device


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
        config = iso_config(config, type(self).__name__)
        super().__init__(num_embeddings, embedding_dim, init_method=init_method, config=config, **kwargs)
        self.iso_profile = config.iso_profile

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.iso_profile == Profile.PERFORMANCE:
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


register_per_device(
    op="embedding",
    impl_id="vocab_embedding.select",
    version="1",
    profile=Profile.CORRECTNESS,
    fn=IsoVocabParallelEmbedding,
    constants={"combine": "all_gather_select_owner"},
    probe_for=lambda device: _probe_embedding,  # one CPU probe serves both device classes
)
register_per_device(
    op="embedding",
    impl_id="vocab_embedding.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=VocabParallelEmbedding,
    constants={"combine": "backend_all_reduce_sum"},
)

__all__ = ["IsoVocabParallelEmbedding"]
