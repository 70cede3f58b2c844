"""The attention family's backend signatures: what ``reference``, ``native`` (SDPA) and ``attention_triton`` answer."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_iso.ops.attention.kv_cache import KVStepPlan
from megatron_iso.ops.common.signatures import Signature


class AttentionVarlen(Protocol):
    """op ``attention``: causal GQA over packed sequences. q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, ``cu_seqlens``
    ``[n+1]`` (int), gate ``[T, Hq, D or 1]`` or None -> ``[T, Hq, D]`` in q's dtype; ``kv_block`` keys per block."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        softmax_scale: float | None = ...,
        gate: torch.Tensor | None = ...,
        kv_block: int = ...,
    ) -> torch.Tensor: ...


class AttentionKVCache(Protocol):
    """op ``attention_kvcache`` (prefill, decode): write new k/v ``[T, Hkv, D]`` at ``cache_seqlens[i]..`` of cache
    row ``slots[i]`` (caches ``[B, S, Hkv, D]``), then attend q ``[T, Hq, D]`` (``cu_seqlens_q [n+1]``) over the
    cache prefix -> ``[T, Hq, D]``. ``plan``: the same layout as host lists (no device read-back)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        *,
        slots: torch.Tensor | None = ...,
        softmax_scale: float | None = ...,
        gate: torch.Tensor | None = ...,
        kv_block: int = ...,
        plan: KVStepPlan | None = ...,
    ) -> torch.Tensor: ...


# The Triton kernels also take a tile config and a key-split choice (benches and the tile tests pin them).
SIGNATURES = (
    Signature("attention", AttentionVarlen, extras={"attention.triton": ("config", "split")}),
    Signature("attention_kvcache", AttentionKVCache, extras={"attention_kvcache.triton": ("config", "split")}),
)
