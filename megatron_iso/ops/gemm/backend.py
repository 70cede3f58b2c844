"""The GEMM family's backend signatures: the dense leaf-tree GEMM, the grouped (MoE expert) GEMM and its
static-shape stock form, as their ``reference``, ``native`` and Triton implementations each answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from megatron_iso.ops.common.signatures import Signature

# Expert weights: one ``[E, N, K]`` tensor or a list of E ``[N, K]`` tensors.
Weights = Sequence[torch.Tensor] | torch.Tensor


class Linear(Protocol):
    """op ``gemm``: fp32 ``x @ weight.T``; x ``[M, K]``, weight ``[N, K]`` (Megatron layout) -> fp32 ``[M, N]``,
    summed as a tree over ``leaves`` slices of K (the native library GEMM takes and ignores ``leaves``)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor: ...


class GroupedLinear(Protocol):
    """op ``grouped_gemm``: rows of x ``[T, K]`` sorted by expert (``counts [E]`` rows each) times their expert's
    ``[N, K]`` weight -> fp32 ``[T, N]``; each row is the dense op's leaf tree with its own expert's weight."""

    def __call__(self, x: torch.Tensor, weights: Weights, counts: torch.Tensor, leaves: int) -> torch.Tensor: ...


class GroupedLinearStatic(Protocol):
    """op ``grouped_gemm_static`` (performance profile, CUDA-graph decode): x ``[T, K]`` sorted by expert, weights
    ``[E, N, K]``, device ``counts [E]`` -> ``[T, N]`` in x's dtype, with no host read of the counts."""

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


SIGNATURES = (
    # The dense kernel also takes a K-split count, a tile config and an output dtype it rounds to as it stores.
    Signature("gemm", Linear, extras={"leaf_tree_gemm.triton": ("parallel", "config", "out_dtype")}),
    Signature("grouped_gemm", GroupedLinear, extras={"grouped_leaf_tree_gemm.triton": ("config", "check_counts")}),
    Signature("grouped_gemm_static", GroupedLinearStatic),
)
