"""Causal attention reference path (CPU): one reduction order over keys for a query position,
whatever the case (training/varlen, prefill into a KV cache, decode from it).

Invariant kept: query ``p``'s arithmetic depends only on ``p``, its own q and keys ``0..p`` (fixed key blocks
aligned at key 0, online softmax in fp32, tree-summed scores and block sums, masked products exactly ``+0``), so
decode, (chunked) prefill and the training forward give the same bits, and other sequences never enter.

Design: docs/KERNELS.md, "Attention reference".
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

from megatron_iso.ops.attention.kv_cache import KVStepPlan, resolve_plan
from megatron_iso.ops.common.ieee_math import iso_exp, iso_sigmoid
from megatron_iso.ops.common.tensor_keyed_cache import TensorKeyedCache
from megatron_iso.ops.common.tree import tree_sum_dim
from megatron_iso.registry import OpImpl, Profile, register

DEFAULT_KV_BLOCK = 64
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None) -> None:
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"attention: q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}; need one of {SUPPORTED_DTYPES}, all equal"
        )
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"attention: q [T, Hq, D], k/v [T, Hkv, D] expected; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    if gate is not None and gate.shape[:2] != q.shape[:2]:
        raise ValueError(f"attention: gate {tuple(gate.shape)} must be [T, Hq, D or 1] for q {tuple(q.shape)}")


def _check_block(kv_block: int) -> None:
    if kv_block <= 0:
        raise ValueError(f"attention: kv_block must be a positive int, got {kv_block}")


# Rows (queries) are processed in chunks so the [D, B, rows, Hq] product stays a few MiB; rows never
# interact, so chunking is only a memory bound and cannot change a bit.
_MAX_PRODUCT_ELEMENTS = 1 << 22


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    kv_len: int,
    scale: float,
    kv_block: int,
) -> torch.Tensor:
    """One sequence. q ``[n, Hq, D]`` at positions ``q_start..``; k/v ``[>= kv_len, Hkv, D]``. Returns fp32."""
    n, hq, d = q.shape
    per_row = d * kv_block * hq
    step = max(1, _MAX_PRODUCT_ELEMENTS // per_row)
    parts = [_attend_rows(q[a : a + step], k, v, q_start + a, kv_len, scale, kv_block) for a in range(0, n, step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    kv_len: int,
    scale: float,
    kv_block: int,
) -> torch.Tensor:
    # Layout: the reduced dimension leads (head_dim for scores, keys for P.V), so tree_sum_dim's
    # halving steps slice whole contiguous sub-blocks: same tree, same bits, much faster than
    # reducing a strided last dimension. GQA without copies: heads viewed as [Hkv, group].
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    dev = q.device  # the reference is a CPU path, but nothing in it is CPU-only
    qt = q.float().view(n, hkv, group, d).permute(3, 0, 1, 2).unsqueeze(1)  # [D, 1, n, Hkv, G]
    scale_t = torch.tensor(scale, dtype=torch.float32, device=dev)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float32, device=dev)
    zero = torch.tensor(0.0, dtype=torch.float32, device=dev)
    m = torch.full((n, hkv, group), float("-inf"), dtype=torch.float32, device=dev)
    l_sum = torch.zeros(n, hkv, group, dtype=torch.float32, device=dev)
    acc = torch.zeros(n, hkv, group, d, dtype=torch.float32, device=dev)
    q_pos = torch.arange(q_start, q_start + n, device=dev)
    n_blocks = (kv_len + kv_block - 1) // kv_block
    for b in range(n_blocks):
        lo = b * kv_block
        # Rows whose position precedes the block see none of its keys; skipping them is only a
        # saving (their state would be left untouched anyway), since rows never mix.
        r0 = max(0, lo - q_start)
        if r0 >= n:
            break
        rows = slice(r0, n)
        hi = min(lo + kv_block, kv_len)
        kb = torch.zeros(kv_block, hkv, d, dtype=torch.float32, device=dev)
        vb = torch.zeros(kv_block, hkv, d, dtype=torch.float32, device=dev)
        kb[: hi - lo] = k[lo:hi].float()
        vb[: hi - lo] = v[lo:hi].float()
        key_pos = torch.arange(lo, lo + kv_block, device=dev)
        valid = (key_pos.unsqueeze(1) <= q_pos[rows].unsqueeze(0)) & (key_pos < kv_len).unsqueeze(1)  # [B, r]
        valid_h = valid.view(kv_block, -1, 1, 1)  # [B, r, 1, 1]
        kt = kb.permute(2, 0, 1).view(d, kv_block, 1, hkv, 1)  # [D, B, 1, Hkv, 1]
        s = tree_sum_dim(qt[:, :, rows] * kt, 0) * scale_t  # [B, r, Hkv, G]
        s = torch.where(valid_h, s, neg_inf)
        m_old = m[rows]
        m_new = torch.maximum(m_old, s.amax(0))  # max is exact: order-free
        alpha = torch.where(m_old == neg_inf, zero, iso_exp(m_old - m_new))
        p = torch.where(valid_h, iso_exp(s - m_new), zero)  # [B, r, Hkv, G]
        vt = vb.view(kv_block, 1, hkv, 1, d)
        pv = torch.where(valid_h.unsqueeze(-1), p.unsqueeze(-1) * vt, zero)  # [B, r, Hkv, G, D]
        l_new = l_sum[rows] * alpha + tree_sum_dim(p, 0)
        acc_new = acc[rows] * alpha.unsqueeze(-1) + tree_sum_dim(pv, 0)
        seen = valid.any(0).view(-1, 1, 1)
        m[rows] = torch.where(seen, m_new, m_old)
        l_sum[rows] = torch.where(seen, l_new, l_sum[rows])
        acc[rows] = torch.where(seen.unsqueeze(-1), acc_new, acc[rows])
    return (acc / l_sum.unsqueeze(-1)).view(n, hq, d)


def _finish(o: torch.Tensor, gate: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if gate is not None:
        o = o * iso_sigmoid(gate)  # Qwen3-Next output gate, applied before the single rounding
    return o.to(dtype)


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


# Host copies of recent cu_seqlens: every attention layer of a forward and of its backward gets the same
# tensor, so a step reads it back (a host sync on a GPU) once, not twice per layer.
_HOST_BOUNDS: TensorKeyedCache[list[int]] = TensorKeyedCache(4)


def _read_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or any(b < a for a, b in pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    return cu


def _bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as checked host ints, read back once per tensor (and per in-place change of it)."""
    return _HOST_BOUNDS.get((cu_seqlens,), None, lambda: _read_bounds(cu_seqlens))


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int = DEFAULT_KV_BLOCK,
) -> torch.Tensor:
    """Causal attention over packed sequences (training / scoring).

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, ``cu_seqlens`` ``[n_seq + 1]`` token offsets; each sequence's
    positions start at 0. ``gate`` (optional, ``[T, Hq, D]`` or ``[T, Hq, 1]``): output * sigmoid(gate).
    """
    _check_qkv(q, k, v, gate)
    _check_block(kv_block)
    cu = _bounds(cu_seqlens)
    if cu[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but q has {q.shape[0]} tokens")
    scale = _scale(softmax_scale, q.shape[-1])
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a, b in pairwise(cu):
        if b > a:
            out[a:b] = _attend(q[a:b], k[a:b], v[a:b], 0, b - a, scale, kv_block)
    return _finish(out, gate, q.dtype)


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
    plan: KVStepPlan | None = None,
) -> torch.Tensor:
    """Prefill (any chunk length) and decode: append k/v to the cache, then attend from the cache.

    Sequence ``i`` owns tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q/k/v, cache row ``slots[i]``
    (default ``i``), and already has ``cache_seqlens[i]`` cached tokens; its new tokens take positions
    ``cache_seqlens[i] ..``. The cache (``[slots, max_len, Hkv, D]``, same dtype as k) is written in
    place before it is read; the caller advances the lengths after the model step. ``plan``: the same
    layout as host lists (:class:`~megatron_iso.ops.attention.kv_cache.KVStepPlan`), read instead of
    the tensors.
    """
    _check_qkv(q, k, v, gate)
    _check_block(kv_block)
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        # A cast on the way into the cache would round keys differently from the training path.
        raise TypeError(f"kv cache dtype {k_cache.dtype}/{v_cache.dtype} must equal k/v dtype {k.dtype}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"kv cache must be [slots, max_len, {k.shape[1]}, {k.shape[2]}], got {tuple(k_cache.shape)}")
    plan = resolve_plan(plan, q, cu_seqlens_q, cache_seqlens, slots)
    cu, starts, slot_ids = plan.cu, plan.starts, plan.slots
    scale = _scale(softmax_scale, q.shape[-1])
    max_len = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, (a, b) in enumerate(pairwise(cu)):
        start, slot = starts[i], slot_ids[i]
        end = start + (b - a)
        if end > max_len:
            raise ValueError(f"sequence {i} (slot {slot}) needs {end} cache positions, cache max_len is {max_len}")
        if b == a:
            continue
        k_cache[slot, start:end] = k[a:b]  # write first: the kernel reads every key from the cache
        v_cache[slot, start:end] = v[a:b]
        out[a:b] = _attend(q[a:b], k_cache[slot], v_cache[slot], start, end, scale, kv_block)
    return _finish(out, gate, q.dtype)


def _probe() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4004)
    lens = [1, 5, 70]
    t = sum(lens)
    q = torch.randn(t, 4, 16, generator=g)
    k = torch.randn(t, 2, 16, generator=g)
    v = torch.randn(t, 2, 16, generator=g)
    gate = torch.randn(t, 4, 16, generator=g)
    cu = torch.tensor([0, 1, 6, 76])
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[f"varlen_{name}"] = attention_varlen(q.to(dt), k.to(dt), v.to(dt), cu)
        out[f"varlen_gated_{name}"] = attention_varlen(q.to(dt), k.to(dt), v.to(dt), cu, gate=gate.to(dt))
    return out


def _probe_kvcache() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4005)
    q = torch.randn(70, 4, 16, generator=g)
    k = torch.randn(70, 2, 16, generator=g)
    v = torch.randn(70, 2, 16, generator=g)
    kc = torch.zeros(1, 80, 2, 16)
    vc = torch.zeros(1, 80, 2, 16)
    one = torch.tensor([0])
    pre = attention_with_kv_cache(q[:69], k[:69], v[:69], kc, vc, one, torch.tensor([0, 69]))
    dec = attention_with_kv_cache(q[69:], k[69:], v[69:], kc, vc, torch.tensor([69]), torch.tensor([0, 1]))
    return {"prefill_fp32": pre, "decode_fp32": dec}


_CONSTANTS = {
    "kv_block": DEFAULT_KV_BLOCK,
    "kv_block_alignment": "key position 0 of the sequence",
    "block_order": "ascending, online softmax (m, l, acc in fp32)",
    "score": "tree_sum_dim(q*k) over head_dim, then * scale (fp32)",
    "block_sums": "tree_sum_dim over the full padded block width; masked terms exactly +0",
    "exp": "fp64 IEEE-composed (ieee_math.iso_exp), rounded to fp32",
    "output": "acc / l, * iso_sigmoid(gate) if gated, rounded once",
    "accumulate_dtype": "fp32",
}
register(
    OpImpl(
        op="attention",
        impl_id="attention.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=attention_varlen,
        constants=_CONSTANTS,
        cases=("trainer_forward", "trainer_score"),
        probe=_probe,
    )
)
register(
    OpImpl(
        op="attention_kvcache",
        impl_id="attention_kvcache.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=attention_with_kv_cache,
        constants={**_CONSTANTS, "cache_write": "before attention; cache dtype == k dtype"},
        cases=("prefill", "decode"),
        equivalence_note=(
            "writes k/v to the cache, then runs the same per-sequence kernel as attention.reference@1 "
            "(_attend) over cache keys 0..start+n-1; each query's arithmetic depends only on its position "
            "and keys 0..p, so prefill/decode == trainer_forward bit for bit (tests/ops/test_attention.py)"
        ),
        probe=_probe_kvcache,
    )
)
