"""Causal attention with GQA and an optional sigmoid output gate, in three cases: packed training
sequences (:func:`attention_varlen`), prefill into a KV cache and decode from it
(:func:`attention_with_kv_cache`, :func:`attention_decode`). Per-head q/k RMSNorm and RoPE are
applied by the model (``ops.norm``, ``ops.rope``) before these calls.

Dispatch as in ``ops.norm``: CPU+correctness = ``reference`` (invariant: one reduction order over
keys for a query position in every case), CUDA+correctness =
``megatron_iso.ops.attention.attention_triton`` (lazy), performance = ``native`` (SDPA); each answers the
Protocols of ``backend``.
Where :func:`paged_kv_reads` holds (the Triton path), :func:`attention_with_paged_kv_cache` reads a
paged KV pool through its block table instead of a contiguous cache.
"""

from __future__ import annotations

import functools

import torch

from megatron_iso.ops.attention import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.attention.autograd import attention_varlen_trainable
from megatron_iso.ops.attention.backend import AttentionKVCache, AttentionVarlen
from megatron_iso.ops.attention.kv_cache import KVCache, KVStepPlan, PagedKVLayer
from megatron_iso.ops.attention.reference import DEFAULT_KV_BLOCK
from megatron_iso.ops.common.dispatch import device_class_of, import_triton_module, runs_triton, select
from megatron_iso.registry import Profile

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
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """Causal attention over packed sequences: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, ``cu_seqlens [n+1]``."""
    fn: AttentionVarlen = select("attention", q, profile, TRITON_MODULE)
    if (
        profile == Profile.CORRECTNESS
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
    profile: str = Profile.CORRECTNESS,
    plan: KVStepPlan | None = None,
) -> torch.Tensor:
    """Prefill/decode: write new k/v at ``cache_seqlens[i]..`` of cache row ``slots[i]``, then attend.

    ``plan``: the same layout as host lists, shared by the step's layers (:class:`KVStepPlan`); with
    it no implementation reads the layout tensors back from the device.
    """
    fn: AttentionKVCache = select("attention_kvcache", q, profile, TRITON_MODULE)
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


def paged_kv_reads(q: torch.Tensor, profile: str) -> bool:
    """Whether the prefill/decode implementation for ``q``'s device class and ``profile`` reads a paged
    pool in place (:func:`attention_with_paged_kv_cache`): the Triton kernel, cuda + correctness. The
    reference (cpu) and native (performance) kernels take a contiguous cache: the pool is staged."""
    return runs_triton(device_class_of(q), profile)


def attention_with_paged_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    paged: PagedKVLayer,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
    profile: str = Profile.CORRECTNESS,
    plan: KVStepPlan | None = None,
) -> torch.Tensor:
    """:func:`attention_with_kv_cache` reading a paged pool through its block table (row ``slots[i]``)
    and writing the new k/v into their pool rows: the registered Triton implementation with block-table
    addressing, same bits as attending from a staged copy. Only where :func:`paged_kv_reads` holds."""
    if not paged_kv_reads(q, profile):
        raise ValueError(
            f"paged kv reads need device class 'cuda' and profile 'correctness' (the Triton kernel), got "
            f"{device_class_of(q)!r}/{str(profile)!r}; stage the pool into a contiguous cache instead"
        )
    fn = select("attention_kvcache", q, profile, TRITON_MODULE)
    mod = import_triton_module(TRITON_MODULE, "paged attention_kvcache on cuda")
    if fn is not mod.attention_with_kv_cache:  # the paged reads are that implementation's addressing only
        raise RuntimeError(f"attention_kvcache on cuda/correctness is {fn!r}, not {TRITON_MODULE}")
    return mod.attention_with_paged_kv_cache(
        q,
        k,
        v,
        paged,
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
    profile: str = Profile.CORRECTNESS,
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
    "PagedKVLayer",
    "attention_decode",
    "attention_varlen",
    "attention_with_kv_cache",
    "attention_with_paged_kv_cache",
    "paged_kv_reads",
]
