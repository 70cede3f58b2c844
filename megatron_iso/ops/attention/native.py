"""Causal attention native path: ``torch.nn.functional.scaled_dot_product_attention`` the way stock
stacks call it: ``is_causal`` over each packed sequence for training, and for the KV-cache cases an
SDPA call over the cache prefix (no mask for a single decode token, an offset causal mask for a
chunk). ATen picks the kernel and its key split from the shapes, so a token's bits can depend on
the case and on the chunking: the baseline the reference path removes. ``kv_block`` is accepted
for signature parity and ignored.
"""

from __future__ import annotations

import functools
from itertools import pairwise

import torch
import torch.nn.functional as F

from megatron_iso.contract.registry import OpImpl, register


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None) -> torch.Tensor:
    """q ``[n, Hq, D]`` at positions ``q_start..``, k/v ``[L, Hkv, D]`` (keys 0..L-1)."""
    n, length = q.shape[0], k.shape[0]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if q_start == 0 and n == length:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    elif n == 1:
        o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)
    else:
        mask = torch.arange(length, device=q.device).unsqueeze(0) <= torch.arange(
            q_start, q_start + n, device=q.device
        ).unsqueeze(1)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _gate(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return o if gate is None else o * torch.sigmoid(gate)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = 0,
) -> torch.Tensor:
    """Per-sequence causal SDPA over packed sequences; output gate in the input dtype."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    out = torch.empty_like(q)
    for a, b in pairwise(cu):
        if b > a:
            out[a:b] = _sdpa(q[a:b], k[a:b], v[a:b], 0, softmax_scale)
    return _gate(out, gate)


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
    kv_block: int = 0,
) -> torch.Tensor:
    """Append to the cache, then SDPA over each sequence's cache prefix."""
    cu = [int(c) for c in cu_seqlens_q.tolist()]
    starts = [int(s) for s in cache_seqlens.tolist()]
    slot_ids = list(range(len(starts))) if slots is None else [int(s) for s in slots.tolist()]
    # (slot, first new cache position, end, first token, end token) of every non-empty sequence
    spans = [(slot_ids[i], starts[i], starts[i] + b - a, a, b) for i, (a, b) in enumerate(pairwise(cu)) if b > a]
    out = torch.empty_like(q)
    if spans and len({s[0] for s in spans}) == len(spans):
        # Distinct slots: no sequence reads another's new keys, so every write goes first (one
        # indexed copy per cache, not two slice copies per sequence) and the outputs are joined
        # once: the host work per sequence is its SDPA call, which gets the same inputs as below.
        dev = k_cache.device
        rows = torch.tensor([slot for slot, start, end, _, _ in spans for _ in range(start, end)], device=dev)
        cols = torch.tensor([p for _, start, end, _, _ in spans for p in range(start, end)], device=dev)
        k_cache[rows, cols] = k[cu[0] : cu[-1]]
        v_cache[rows, cols] = v[cu[0] : cu[-1]]
        parts = [
            _sdpa(q[a:b], k_cache[slot, :end], v_cache[slot, :end], start, softmax_scale)
            for slot, start, end, a, b in spans
        ]
        out[cu[0] : cu[-1]] = torch.cat(parts)
        return _gate(out, gate)
    for slot, start, end, a, b in spans:  # a slot twice: each sequence reads what those before it wrote
        k_cache[slot, start:end] = k[a:b]
        v_cache[slot, start:end] = v[a:b]
        out[a:b] = _sdpa(q[a:b], k_cache[slot, :end], v_cache[slot, :end], start, softmax_scale)
    return _gate(out, gate)


def _probe(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4004)
    q, k, v = (torch.randn(76, h, 16, generator=g).to(device) for h in (4, 2, 2))
    kc, vc = (torch.zeros(1, 80, 2, 16, device=device) for _ in range(2))
    cu = torch.tensor([0, 1, 6, 76])
    return {
        "varlen_fp32": attention_varlen(q, k, v, cu),
        "varlen_bf16": attention_varlen(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu),
        "kvcache_fp32": attention_with_kv_cache(q, k, v, kc, vc, torch.tensor([0]), torch.tensor([0, 76])),
    }


for _dev in ("cpu", "cuda"):
    register(
        OpImpl(
            op="attention",
            impl_id="attention.native",
            version="1",
            device_class=_dev,
            profile="performance",
            fn=attention_varlen,
            constants={"kernel": "torch sdpa, is_causal per sequence (ATen chooses the backend)"},
            cases=("trainer_forward", "trainer_score"),
            probe=functools.partial(_probe, _dev),
        )
    )
    register(
        OpImpl(
            op="attention_kvcache",
            impl_id="attention_kvcache.native",
            version="1",
            device_class=_dev,
            profile="performance",
            fn=attention_with_kv_cache,
            constants={"kernel": "torch sdpa over the cache prefix (no mask for decode, offset mask for chunks)"},
            cases=("prefill", "decode"),
            equivalence_note="none claimed: stock execution, the mismatch baseline",
        )
    )
