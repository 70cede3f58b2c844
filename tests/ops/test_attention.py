"""Attention: prefill + decode == training forward bit for bit (any prompt length and chunking),
pack/batch composition invariance, GQA + gate accuracy, and the native (SDPA) gap."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_iso.ops.attention import (
    KVCache,
    attention_decode,
    attention_varlen,
    attention_with_kv_cache,
)
from megatron_iso.registry import lookup
from megatron_iso.testing.bits import bits, same_bits

DTYPES = [torch.float32, torch.bfloat16]
HQ, HKV, D = 4, 2, 16
TOTAL = 134  # > 2 key blocks of 64


def _seq(n: int, dtype: torch.dtype, seed: int, gated: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HQ, D, generator=g).to(dtype)
    k = torch.randn(n, HKV, D, generator=g).to(dtype)
    v = torch.randn(n, HKV, D, generator=g).to(dtype)
    gate = torch.randn(n, HQ, D, generator=g).to(dtype) if gated else None
    return q, k, v, gate


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _generate(q, k, v, gate, chunks: list[int], dtype, profile="correctness", max_len=160, garbage=False):
    """Chunked prefill with the given pieces, then one-token decode steps to the end."""
    n = q.shape[0]
    cache = KVCache.allocate(1, 2, max_len, HKV, D, dtype=dtype)
    kc, vc = cache.layer(0)
    if garbage:  # stale contents of a reused slot must never leak into a result
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))
    slot = torch.tensor([1])
    outs, pos = [], 0
    for c in [*chunks, *[1] * (n - sum(chunks))]:
        sl = slice(pos, pos + c)
        gt = None if gate is None else gate[sl]
        if c == 1 and pos >= sum(chunks):
            o = attention_decode(q[sl], k[sl], v[sl], kc, vc, cache.lengths[slot], slots=slot, gate=gt, profile=profile)
        else:
            o = attention_with_kv_cache(
                q[sl], k[sl], v[sl], kc, vc, cache.lengths[slot], _cu([c]), slots=slot, gate=gt, profile=profile
            )
        cache.advance(slot, [c])
        outs.append(o)
        pos += c
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prompt", [1, 63, 64, 65, 130])
def test_prefill_then_decode_equals_training(dtype: torch.dtype, prompt: int) -> None:
    q, k, v, gate = _seq(TOTAL, dtype, seed=prompt, gated=prompt % 2 == 1)
    train = attention_varlen(q, k, v, _cu([TOTAL]), gate=gate)
    gen = _generate(q, k, v, gate, [prompt], dtype)
    mismatch = (bits(gen) != bits(train)).reshape(TOTAL, -1).any(-1).nonzero().flatten().tolist()
    assert mismatch == [], f"positions differing: {mismatch[:10]}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_any_pieces(dtype: torch.dtype) -> None:
    q, k, v, _ = _seq(TOTAL, dtype, seed=7)
    train = attention_varlen(q, k, v, _cu([TOTAL]))
    for chunks in ([5, 59, 1, 64, 3], [64, 64], [1, 1, 127], [33, 33, 33, 33], [TOTAL]):
        assert same_bits(_generate(q, k, v, None, chunks, dtype), train), f"chunks {chunks}"
    # garbage (NaN) in the cache beyond the written length never reaches the output
    assert same_bits(_generate(q, k, v, None, [70], dtype, garbage=True), train)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_pack_composition(dtype: torch.dtype) -> None:
    """A sequence's output does not depend on the other sequences of the pack (N = 1, 2, 3, 7, 8, 64)."""
    g = torch.Generator().manual_seed(11)
    lengths = [int(x) for x in torch.randint(1, 24, (64,), generator=g)]
    lengths[:4] = [1, 64, 65, 130]
    seqs = [_seq(n, dtype, seed=100 + i) for i, n in enumerate(lengths)]
    alone = [attention_varlen(q, k, v, _cu([q.shape[0]])) for q, k, v, _ in seqs]
    order = torch.randperm(64, generator=g).tolist()
    for n_seq in (1, 2, 3, 7, 8, 64):
        for pick in (list(range(n_seq)), order[:n_seq])[: 1 if n_seq == 64 else 2]:
            q, k, v = (torch.cat([seqs[i][j] for i in pick]) for j in range(3))
            out = attention_varlen(q, k, v, _cu([lengths[i] for i in pick]))
            got = out.split([lengths[i] for i in pick])
            for i, o in zip(pick, got, strict=True):
                assert same_bits(o, alone[i]), f"N={n_seq}, seq {i}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_batch_composition(dtype: torch.dtype) -> None:
    """Continuous batching: one call mixing a prefill chunk and decode tokens of other sequences, in
    any slot order, equals each sequence's training forward."""
    lengths = [40, 70, 3]
    seqs = [_seq(n, dtype, seed=200 + i, gated=True) for i, n in enumerate(lengths)]
    train = [attention_varlen(q, k, v, _cu([q.shape[0]]), gate=gt) for q, k, v, gt in seqs]
    cache = KVCache.allocate(1, 5, 96, HKV, D, dtype=dtype)
    kc, vc = cache.layer(0)
    slots = [4, 0, 2]
    # step 0: prefill sequences 0 and 1 partially, sequence 2 fully, in one call
    plan = [[30, 66, 3]] + [[1, 1, 0]] * 4 + [[6, 0, 0]]
    done = [0, 0, 0]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for step in plan:
        active = [i for i in range(3) if step[i] > 0]
        active = active[::-1] if len(outs[0]) % 2 else active  # vary the order within the batch
        parts = [[t[done[i] : done[i] + step[i]] for t in seqs[i]] for i in active]
        q, k, v, gt = (torch.cat([p[j] for p in parts]) for j in range(4))
        o = attention_with_kv_cache(
            q,
            k,
            v,
            kc,
            vc,
            cache.lengths[torch.tensor([slots[i] for i in active])],
            _cu([step[i] for i in active]),
            slots=torch.tensor([slots[i] for i in active]),
            gate=gt,
        )
        for i, piece in zip(active, o.split([step[i] for i in active]), strict=True):
            outs[i].append(piece)
        cache.advance([slots[i] for i in active], [step[i] for i in active])
        for i in active:
            done[i] += step[i]
    for i in range(3):
        assert same_bits(torch.cat(outs[i]), train[i]), f"sequence {i}"


def _naive64(q, k, v, scale, gate=None):
    n = q.shape[0]
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    return o if gate is None else o * torch.sigmoid(gate.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_vs_float64(dtype: torch.dtype) -> None:
    q, k, v, gate = _seq(100, dtype, seed=5, gated=True)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for scale, gt in ((None, None), (0.07, gate)):
        out = attention_varlen(q, k, v, _cu([100]), softmax_scale=scale, gate=gt).double()
        want = _naive64(q, k, v, 1 / math.sqrt(D) if scale is None else scale, gt)
        assert (out - want).abs().max().item() < tol


def test_other_kv_block_and_errors() -> None:
    q, k, v, _ = _seq(50, torch.float32, seed=9)
    train = attention_varlen(q, k, v, _cu([50]), kv_block=16)
    kc = torch.zeros(1, 64, HKV, D)
    vc = torch.zeros(1, 64, HKV, D)
    pre = attention_with_kv_cache(q[:20], k[:20], v[:20], kc, vc, torch.tensor([0]), _cu([20]), kv_block=16)
    rest = [
        attention_decode(q[p : p + 1], k[p : p + 1], v[p : p + 1], kc, vc, torch.tensor([p]), kv_block=16)
        for p in range(20, 50)
    ]
    assert same_bits(torch.cat([pre, *rest]), train)
    with pytest.raises(TypeError, match="cache dtype"):
        attention_with_kv_cache(q[:1], k[:1], v[:1], kc.bfloat16(), vc.bfloat16(), torch.tensor([0]), _cu([1]))
    with pytest.raises(ValueError, match="max_len"):
        attention_with_kv_cache(q[:5], k[:5], v[:5], kc, vc, torch.tensor([62]), _cu([5]))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention_varlen(q[:, :3], k, v, _cu([50]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_varlen(q, k, v, _cu([49]))
    cache = KVCache.allocate(1, 1, 4, HKV, D)
    with pytest.raises(ValueError, match="overflow"):
        cache.advance([0], [5])


def test_registry_probes() -> None:
    for op in ("attention", "attention_kvcache"):
        impl = lookup(op, "cpu", "correctness")
        a, b = impl.probe(), impl.probe()
        assert all(same_bits(a[key], b[key]) for key in a)
    # the probe's decode step equals the varlen forward's last position
    p = lookup("attention_kvcache", "cpu", "correctness").probe()
    assert p["decode_fp32"].shape == (1, HQ, D)


def test_native_differences_measured() -> None:
    """SDPA: decode/prefill vs training and packing; measured and printed, reference asserted 0."""
    for dtype in DTYPES:
        n = 90
        q, k, v, _ = _seq(n, dtype, seed=1)
        for profile in ("correctness", "performance"):
            train = attention_varlen(q, k, v, _cu([n]), profile=profile)
            rows, worst = {}, 0.0
            for prompt in (1, 40, 65):
                gen = _generate(q, k, v, None, [prompt], dtype, profile=profile)
                rows[prompt] = int((bits(gen) != bits(train)).reshape(n, -1).any(-1).sum())
                worst = max(worst, (gen.float() - train.float()).abs().max().item())
            d = (attention_varlen(q, k, v, _cu([n]), profile="performance").float() - train.float()).abs()
            print(
                f"attention {profile} {dtype}: of {n} positions, those where prefill(P)+decode != training, by P: {rows}; "
                f"max |generated - training| {worst:.3g}; |native - this| training max {d.max().item():.3g}"
            )
            if profile == "correctness":
                assert set(rows.values()) == {0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_gate_chain_prefill_decode(dtype: torch.dtype) -> None:
    """The Qwen3-Next attention chain as a model calls it (per-head q/k RMSNorm, partial RoPE at 0.25
    with positions computed per call, gated attention): prefill 65 + decode == one training forward."""
    from megatron_iso.ops.norm import rms_norm
    from megatron_iso.ops.rope import apply_rope, rope_cos_sin, rotary_dim_for

    n, d = 80, 32
    g = torch.Generator().manual_seed(21)
    q = torch.randn(n, HQ, d, generator=g).to(dtype)
    k = torch.randn(n, HKV, d, generator=g).to(dtype)
    v = torch.randn(n, HKV, d, generator=g).to(dtype)
    gate = torch.randn(n, HQ, d, generator=g).to(dtype)
    wq, wk = ((torch.randn(d, generator=g) * 0.1).to(dtype) for _ in range(2))
    rd = rotary_dim_for(d, 0.25)

    def prep(sl: slice, positions: torch.Tensor):
        cos, sin = rope_cos_sin(positions, rd, 10_000_000.0)
        qn = apply_rope(rms_norm(q[sl], wq, 1e-6, zero_centered=True), cos, sin)
        kn = apply_rope(rms_norm(k[sl], wk, 1e-6, zero_centered=True), cos, sin)
        return qn, kn

    qn, kn = prep(slice(0, n), torch.arange(n))
    train = attention_varlen(qn, kn, v, _cu([n]), gate=gate)
    kc, vc = (torch.zeros(1, n, HKV, d, dtype=dtype) for _ in range(2))
    qp, kp = prep(slice(0, 65), torch.arange(65))
    outs = [attention_with_kv_cache(qp, kp, v[:65], kc, vc, torch.tensor([0]), _cu([65]), gate=gate[:65])]
    for p in range(65, n):
        qd, kd = prep(slice(p, p + 1), torch.tensor([p]))
        outs.append(attention_decode(qd, kd, v[p : p + 1], kc, vc, torch.tensor([p]), gate=gate[p : p + 1]))
    assert same_bits(torch.cat(outs), train)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_is_portable_to_cuda_tensors() -> None:
    """The reference uses only correctly rounded ops, so it gives the CPU's bits on a GPU too
    (measured on an H200, torch 2.11+cu130): one digest for the torch reference wherever it runs."""
    from megatron_iso.ops.attention.reference import attention_varlen as ref_varlen
    from megatron_iso.ops.common.ieee_math import iso_silu
    from megatron_iso.ops.rope.reference import rope_cos_sin

    for dtype in DTYPES:
        q, k, v, gate = _seq(134, dtype, seed=3, gated=True)
        cpu = ref_varlen(q, k, v, _cu([134]), gate=gate)
        gpu = ref_varlen(q.cuda(), k.cuda(), v.cuda(), _cu([134]), gate=gate.cuda()).cpu()
        assert same_bits(cpu, gpu)
    x = torch.randn(10000) * 10
    assert same_bits(iso_silu(x), iso_silu(x.cuda()).cpu())
    pos = torch.arange(0, 200000, 7)
    assert same_bits(rope_cos_sin(pos, 64, 1e6)[0], rope_cos_sin(pos.cuda(), 64, 1e6)[0].cpu())
