"""Causal attention native path: ``torch.nn.functional.scaled_dot_product_attention`` the way stock
stacks call it: one masked call over the packed sequences padded to the longest for training, and for the KV-cache cases
(an engine step) one masked SDPA call per layer over all sequences' cache rows, read in place (a
per-sequence call over the cache prefix where slots repeat or padding would double the work). ATen picks the kernel and its key split from the shapes, so a token's bits can depend on
the case and on the chunking: the baseline the reference path removes. ``kv_block`` is accepted
for signature parity and ignored.
"""

from __future__ import annotations

import functools
from itertools import pairwise

import torch
import torch.nn.functional as F

from megatron_iso.ops.attention.autograd import padded_index
from megatron_iso.ops.attention.kv_cache import KVStepPlan, resolve_plan
from megatron_iso.registry import Profile, register_per_device


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
    """Causal SDPA over packed sequences, output gate in the input dtype: one masked call over the
    sequences padded to the longest (what a varlen kernel does in one launch), or one call per sequence
    where padding would more than double the work."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    lens = [b - a for a, b in pairwise(cu)]
    out = torch.empty_like(q)
    real = [n for n in lens if n > 0]
    if len(real) > 1 and len(real) == len(lens) and len(lens) * max(lens) <= 2 * sum(lens):
        a, b = cu[0], cu[-1]
        out[a:b] = _sdpa_padded(q[a:b], k[a:b], v[a:b], lens, softmax_scale)
        return _gate(out, gate)
    for a, b in pairwise(cu):
        if b > a:
            out[a:b] = _sdpa(q[a:b], k[a:b], v[a:b], 0, softmax_scale)
    return _gate(out, gate)


def _sdpa_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float | None):
    """Consecutive sequences of ``lens`` as one padded batch: causal + key-padding mask, one SDPA call."""
    rows, valid = padded_index(lens, q.device)

    def padded(t: torch.Tensor) -> torch.Tensor:  # [total, H, D] -> [B, H, L, D]
        return torch.cat([t, t.new_zeros(1, *t.shape[1:])])[rows].transpose(1, 2)

    longest = rows.shape[1]
    causal = torch.ones(longest, longest, dtype=torch.bool, device=q.device).tril()
    mask = (causal[None] & valid[:, None, :]).unsqueeze(1)  # [B, 1, L, L]; key 0 is always visible
    o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)[valid]


def _batched_index(plan: KVStepPlan, max_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The step's index tensors for :func:`_attend_batched` (built once per step, shared by the layers).

    Sequence i's tokens sit at rows ``i * width + t`` of a ``[n * width]`` padded query layout (width =
    the longest new chunk); ``cache_row`` is each new token's row in the flattened cache; ``visible``
    says which of the first ``keys`` cache positions a query at padded position (i, t) sees (those up
    to its absolute position; padded positions see key 0 only, so no row is fully masked). Cache
    contents past a sequence's length but before ``keys`` enter SDPA with probability 0; like any
    dense-masked SDPA this assumes they are finite (stale keys of earlier tokens always are).
    """
    lens = torch.tensor(plan.lengths, dtype=torch.int64)
    n, width = len(plan.lengths), max(plan.lengths)
    seq = torch.repeat_interleave(torch.arange(n), lens)
    offset = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seq]
    starts = torch.tensor(plan.starts, dtype=torch.int64)
    t = torch.arange(width)
    key_end = torch.where(t < lens.unsqueeze(1), starts.unsqueeze(1) + t + 1, 1)  # [n, width]
    keys = int((starts + lens).max())  # the longest sequence's cache length: no key past it is read
    slots = torch.tensor(plan.slots, dtype=torch.int64)
    out = {
        "cache_row": slots[seq] * max_len + starts[seq] + offset,
        "padded_row": seq * width + offset,
        # [n, width, keys] visibility, the mask SDPA takes (True = attend)
        "visible": torch.arange(keys) < key_end.unsqueeze(-1),
    }
    if plan.slots != list(range(n)):
        out["slots"] = slots
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}


def _attend_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: KVStepPlan,
    index: dict[str, torch.Tensor],
    scale: float | None,
) -> torch.Tensor:
    """ONE masked SDPA call for all sequences of the step, reading the cache rows in place.

    GQA the way decode kernels batch it: a kv head's query heads (and, for a chunk, its tokens) are
    the query rows of one attention problem, so SDPA sees no GQA and k/v are never repeated.
    """
    n, width = len(plan.lengths), max(plan.lengths)
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv
    visible = index["visible"]
    keys = visible.shape[-1]
    # Slot i = sequence i (the engine's staged view): the cache rows are read in place; other slot
    # orders gather the rows first (tests and direct callers).
    kc = k_cache if "slots" not in index else k_cache.index_select(0, index["slots"])
    vc = v_cache if "slots" not in index else v_cache.index_select(0, index["slots"])
    kt, vt = kc[:n, :keys].transpose(1, 2), vc[:n, :keys].transpose(1, 2)  # [n, Hkv, keys, D] views
    if width == 1:  # decode: q [n, Hq, D] is already [n, Hkv, G, D] (heads of a kv group are adjacent)
        qb = q.reshape(n, hkv, group, d)
        mask = visible.view(n, 1, 1, keys)
    else:
        padded = q.new_zeros(n * width, hq, d).index_copy_(0, index["padded_row"], q)
        qb = padded.view(n, width, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, width * group, d)
        mask = plan.memo(
            ("native_chunk_mask", group, visible.device),
            lambda: visible.unsqueeze(2).expand(n, width, group, keys).reshape(n, 1, width * group, keys),
        )
    o = F.scaled_dot_product_attention(qb, kt, vt, attn_mask=mask, scale=scale)
    if width == 1:
        return o.reshape(n, hq, d)
    o = o.view(n, hkv, width, group, d).permute(0, 2, 1, 3, 4).reshape(n * width, hq, d)
    return o.index_select(0, index["padded_row"])


def _decode_from_device(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    slots: torch.Tensor | None,
    plan: KVStepPlan,
    scale: float | None,
) -> torch.Tensor:
    """A decode step whose positions live only in ``cache_seqlens`` on the device (a captured graph's
    buffers, rewritten between replays): the write rows and the visibility mask are derived there, at
    every call, so nothing position-dependent is baked into the graph. Every key of the cache enters
    SDPA (masked past each row's position), as in :func:`_attend_batched`."""
    n, max_len = len(plan.lengths), k_cache.shape[1]
    if any(n_q != 1 for n_q in plan.lengths) or len(set(plan.slots)) != n:
        raise ValueError("a device_positions plan is a decode step: one token per sequence, distinct slots")
    dev = k_cache.device
    starts = cache_seqlens.to(torch.int64)
    rows = torch.arange(n, device=dev) if slots is None else slots.to(torch.int64)
    cache_row = rows * max_len + starts
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, cache_row, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, cache_row, v)
    index = {"visible": (torch.arange(max_len, device=dev) < (starts + 1).unsqueeze(-1)).unsqueeze(1)}
    if plan.slots != list(range(n)):
        index["slots"] = rows
    return _attend_batched(q, k_cache, v_cache, plan, index, scale)


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
    plan: KVStepPlan | None = None,
) -> torch.Tensor:
    """Append to the cache, then attend over each sequence's cache prefix.

    Distinct slots (every engine step): one indexed write per cache and ONE masked SDPA call for the
    whole step (decode, and prefill chunks while padding them to the longest costs at most twice the
    real tokens), as stock servers run one batched attention kernel per layer and step. Otherwise an
    SDPA call per sequence.
    """
    plan = resolve_plan(plan, q, cu_seqlens_q, cache_seqlens, slots, reads_device_positions=True)
    if plan.device_positions:
        return _gate(_decode_from_device(q, k, v, k_cache, v_cache, cache_seqlens, slots, plan, softmax_scale), gate)
    cu, starts, slot_ids = plan.cu, plan.starts, plan.slots
    # (slot, first new cache position, end, first token, end token) of every non-empty sequence
    spans = [(slot_ids[i], starts[i], starts[i] + b - a, a, b) for i, (a, b) in enumerate(pairwise(cu)) if b > a]
    out = torch.empty_like(q)
    max_len = k_cache.shape[1]
    if any(end > max_len for _, _, end, _, _ in spans):
        raise ValueError(f"kv cache max_len {max_len} is too short for this step (ends {[s[2] for s in spans]})")
    lengths = plan.lengths
    if spans and len(spans) == len(lengths) and len(set(slot_ids)) == len(slot_ids):
        # Distinct slots: no sequence reads another's new keys, so every write goes first.
        dev = k_cache.device
        index = plan.memo(("native_index", max_len, dev), lambda: _batched_index(plan, max_len, dev))
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, index["cache_row"], k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, index["cache_row"], v)
        if len(lengths) * max(lengths) <= 2 * cu[-1]:
            return _gate(_attend_batched(q, k_cache, v_cache, plan, index, softmax_scale), gate)
        parts = [
            _sdpa(q[a:b], k_cache[slot, :end], v_cache[slot, :end], start, softmax_scale)
            for slot, start, end, a, b in spans
        ]
        return _gate(torch.cat(parts), gate)
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


register_per_device(
    op="attention",
    impl_id="attention.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=attention_varlen,
    constants={
        "kernel": "torch sdpa: one masked call over the sequences padded to the longest (per-sequence "
        "is_causal where padding would more than double the work); ATen chooses the backend"
    },
    cases=("trainer_forward", "trainer_score"),
    probe_for=lambda device: functools.partial(_probe, device),
)
register_per_device(
    op="attention_kvcache",
    impl_id="attention_kvcache.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=attention_with_kv_cache,
    constants={"kernel": "torch sdpa over the cache prefix (no mask for decode, offset mask for chunks)"},
    cases=("prefill", "decode"),
    equivalence_note="none claimed: stock execution, the mismatch baseline",
)
