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
import importlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_iso.contract.registry import lookup
from megatron_iso.ops.attention import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.attention.autograd import attention_varlen_trainable
from megatron_iso.ops.attention.kv_cache import KVCache
from megatron_iso.ops.attention.reference import DEFAULT_KV_BLOCK

TRITON_MODULE = "megatron_iso.ops.attention.attention_triton"


def _select(op: str, fn_name: str, t: torch.Tensor, profile: str) -> Callable[..., Any]:
    """The registered implementation for (op, device class of ``t``, profile).

    The Triton module is imported only on demand (it needs triton and a GPU); importing it registers
    its cuda/correctness entries. Fallback for a module that does not register: its function named
    ``fn_name`` or ``fn_name + "_triton"``.
    """
    device_class = "cuda" if t.device.type == "cuda" else "cpu"
    if device_class == "cuda" and profile == "correctness":
        try:
            module = importlib.import_module(TRITON_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name != TRITON_MODULE:
                raise
            raise NotImplementedError(
                f"{op} on cuda/correctness needs {TRITON_MODULE} (function {fn_name}), not written yet"
            ) from exc
        try:
            return lookup(op, device_class, profile).fn
        except KeyError:
            fn = getattr(module, fn_name, None) or getattr(module, f"{fn_name}_triton", None)
            if fn is None:
                raise NotImplementedError(
                    f"{TRITON_MODULE} neither registers op {op!r} (cuda, correctness) nor defines {fn_name}"
                ) from None
            return fn
    return lookup(op, device_class, profile).fn


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
    fn = _select("attention", "attention_varlen", q, profile)
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
) -> torch.Tensor:
    """Prefill/decode: write new k/v at ``cache_seqlens[i]..`` of cache row ``slots[i]``, then attend."""
    fn = _select("attention_kvcache", "attention_with_kv_cache", q, profile)
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


__all__ = ["DEFAULT_KV_BLOCK", "KVCache", "attention_decode", "attention_varlen", "attention_with_kv_cache"]
