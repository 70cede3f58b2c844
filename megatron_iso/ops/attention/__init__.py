"""Causal attention with GQA and an optional sigmoid output gate, in three cases: packed training
sequences (:func:`attention_varlen`), prefill into a KV cache and decode from it
(:func:`attention_with_kv_cache`, :func:`attention_decode`). Per-head q/k RMSNorm and RoPE are
applied by the model (``ops.norm``, ``ops.rope``) before these calls.

Dispatch as in ``ops.norm``: CPU+correctness = ``reference`` (invariant: one reduction order over
keys for a query position in every case), CUDA+correctness =
``megatron_iso.ops.attention.attention_triton`` (lazy, same signatures), performance = ``native`` (SDPA).
"""

from __future__ import annotations

import functools

import torch

from megatron_iso.ops.attention import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.attention.autograd import attention_varlen_trainable
from megatron_iso.ops.attention.kv_cache import KVCache, KVStepPlan
from megatron_iso.ops.attention.reference import DEFAULT_KV_BLOCK
from megatron_iso.ops.dispatch import select

TRITON_MODULE = "megatron_iso.ops.attention.attention_triton"


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
    profile: str = "correctness",
) -> torch.Tensor:
    """Causal attention over packed sequences: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, ``cu_seqlens [n+1]``."""
    fn = select("attention", q, profile, TRITON_MODULE)
    if (
        profile == "correctness"
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (q, k, v, gate))
    ):
        # The invariant kernels are forward-only; training gets a deterministic plain backward.
        return attention_varlen_trainable(
            functools.partial(fn, kv_block=kv_block), q, k, v, cu_seqlens, softmax_scale=softmax_scale, gate=gate
        )
    return fn(q, k, v, cu_seqlens, softmax_scale=softmax_scale, gate=gate, kv_block=kv_block)


def attention_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
    profile: str = "correctness",
    plan: KVStepPlan | None = None,
) -> torch.Tensor:
    """Prefill/decode: write new k/v at ``cache_seqlens[i]..`` of cache row ``slots[i]``, then attend.

    ``plan``: the same layout as host lists, shared by the step's layers (:class:`KVStepPlan`); with
    it no implementation reads the layout tensors back from the device.
    """
    fn = select("attention_kvcache", q, profile, TRITON_MODULE)
    return fn(
        q,
        k,
        v,
        k_cache,
        v_cache,
        cache_seqlens,
        cu_seqlens_q,
        slots=slots,
        softmax_scale=softmax_scale,
        gate=gate,
        kv_block=kv_block,
        plan=plan,
    )


def attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
    profile: str = "correctness",
) -> torch.Tensor:
    """One new token per sequence: q ``[B, Hq, D]``, k/v ``[B, Hkv, D]`` (the same kernel as prefill)."""
    cu = torch.arange(q.shape[0] + 1)
    return attention_with_kv_cache(
        q,
        k,
        v,
        k_cache,
        v_cache,
        cache_seqlens,
        cu,
        slots=slots,
        softmax_scale=softmax_scale,
        gate=gate,
        kv_block=kv_block,
        profile=profile,
    )


__all__ = [
    "DEFAULT_KV_BLOCK",
    "KVCache",
    "KVStepPlan",
    "attention_decode",
    "attention_varlen",
    "attention_with_kv_cache",
]
