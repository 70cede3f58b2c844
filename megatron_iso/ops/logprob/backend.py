"""The log-softmax family's backend signature: what ``reference``, ``native`` and ``logprob_triton`` each answer."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_iso.ops.common.signatures import Signature
from megatron_iso.ops.logprob.native import NativeScores
from megatron_iso.ops.logprob.reference import Comm, VocabScores


class Scores(Protocol):
    """op ``logprob``: the row statistics of logits ``[R, ..., V/C]`` (R local vocab shards of C in all, ``comm``
    joins them across ranks), queried with ``.token_logprobs(ids [...])``, ``.entropy()``, ``.log_softmax()``.
    ``valid_vocab``: real ids below it (the rest is Megatron's padding); ``leaves``: the vocab leaf tree
    (the native path ignores it)."""

    def __call__(
        self,
        logits: torch.Tensor,
        comm: Comm,
        *,
        temperature: float | torch.Tensor,
        leaves: int,
        valid_vocab: int | None,
    ) -> VocabScores | NativeScores: ...


SIGNATURES = (Signature("logprob", Scores),)
