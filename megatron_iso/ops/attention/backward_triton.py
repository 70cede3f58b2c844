"""Causal GQA attention backward over packed sequences in Triton, FlashAttention-2 style: the training
path's gradient on CUDA (the invariant forward kernels are forward-only).

Deterministic, not invariant: every gradient element is accumulated by one program in a fixed loop
order and no atomics are used, so the same inputs give the same bits on every call. Three kernels:

- ``_stats_kernel``: per (query block, head) the softmax statistics ``lse`` (online softmax over the causal
  key blocks) and ``delta = rowsum(dO * o)`` from the fp32 output ``o`` it holds; with a gate ``o`` is stored
  instead (the gate's gradient needs it) and ``delta`` is taken in torch;
- ``_dkdv_kernel``: per (key block, kv head) loops over the head's query group and the query blocks at
  or after the key block, accumulating ``dK`` and ``dV`` in fp32;
- ``_dq_kernel``: per (query block, head) loops over the causal key blocks, accumulating ``dQ``.

Products run on tensor cores in the inputs' dtype with fp32 accumulation; ``p`` and ``ds`` are rounded
to that dtype before their products, as in FlashAttention-2. Under ``TRITON_INTERPRET=1`` the products
take fp32 operands (the interpreter's bf16 ``tl.dot`` is wrong). The readable reference this kernel is
tested against is ``ops.attention.autograd``'s plain padded attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.interpret import INTERPRET as _INTERPRET

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class BackwardTile:
    """One backward kernel's launch: query rows and key rows per tile, warps, pipeline stages. The backward is
    deterministic, not invariant, so its tiles are free: any tile gives the same bits on every call (each gradient
    element is summed by one program in a fixed order), though two tiles' gradients differ in rounding."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BackwardTiles:
    """The tiles of the three kernels: the recomputed statistics, dK / dV, dQ."""

    stats: BackwardTile
    dkdv: BackwardTile
    dq: BackwardTile


_INTERPRET_TILES = BackwardTiles(*(BackwardTile(16, 16, 4, 1),) * 3)
# 16-bit inputs: tensor-core dots. Head dims up to 128: the fastest tiles of ``bench_ops.py
# --attention-backward-sweep`` on an H200 (Qwen3-8B heads; dK / dV at 128 x 64 took the backward from 2.01 / 2.79 /
# 9.07 ms to 1.74 / 2.25 / 7.08 at 16 x 768 / 4 x 2048 / 1 x 8192). Larger head dims keep 64 x 64 tiles: 128-row
# tiles of a 256-wide head exceed the shared memory. In that sweep every dK / dV and dQ tile gave the same gradient
# bits as 64 x 64 (their dots appear to add the reduced dimension in 16-wide steps in one order whatever the block);
# a statistics tile with another key block did not.
_TILES_16 = BackwardTiles(BackwardTile(128, 64, 8, 3), BackwardTile(128, 64, 8, 2), BackwardTile(128, 64, 8, 3))
_TILES_16_WIDE = BackwardTiles(BackwardTile(64, 64, 4, 2), BackwardTile(64, 64, 8, 2), BackwardTile(64, 64, 4, 2))
# fp32's dots are FMA loops; left to itself ptxas gives these kernels 32 registers and spills (on sm_90, 64 x 64
# tiles: 7.9-17.7 KB stacks, 13-22 thousand local-memory operations in their loops). fp32 runs 32 x 32 tiles under a
# 255-register cap: 32-576 B, 0-302.
FP32_MAXNREG = 255
_TILES_FP32 = BackwardTiles(BackwardTile(32, 32, 4, 2), BackwardTile(32, 32, 8, 2), BackwardTile(32, 32, 4, 2))


def backward_tiles(dtype: torch.dtype, head_dim: int) -> BackwardTiles:
    """The shipped tiles for inputs of ``dtype`` and ``head_dim``."""
    if _INTERPRET:
        return _INTERPRET_TILES
    if dtype == torch.float32:
        return _TILES_FP32
    return _TILES_16 if head_dim <= 128 else _TILES_16_WIDE


@triton.jit
def _operand(t, DOT_FP32: tl.constexpr, dtype: tl.constexpr):
    if DOT_FP32:
        return t.to(tl.float32)
    return t.to(dtype)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    # fp32 operands multiply exactly ("ieee"), never through TF32.
    if DOT_FP32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _sequence(CU, seq):
    start = tl.load(CU + seq)
    return start, tl.load(CU + seq + 1) - start


@triton.jit
def _tile(PTR, start, idx, ok, s_t, head, s_h, dims, DOT_FP32: tl.constexpr, dtype: tl.constexpr):
    """Rows ``start + idx`` of one head, zero where not ``ok``, as a product operand."""
    t = tl.load(PTR + (start + idx)[:, None] * s_t + head * s_h + dims[None, :], mask=ok[:, None], other=0.0)
    return _operand(t, DOT_FP32, dtype)


@triton.jit
def _probs_and_score_grads(q, k, v, do, lse, delta, rows, keys, row_ok, key_ok, qk_scale, DOT_FP32: tl.constexpr):
    """``p = softmax`` probabilities (causal, recomputed from ``lse``) and ``ds = p * (dO v^T - delta)``."""
    s = _dot(q, tl.trans(k), DOT_FP32) * qk_scale
    allowed = (keys[None, :] <= rows[:, None]) & key_ok[None, :] & row_ok[:, None]
    p = tl.where(allowed, tl.exp2(s - lse[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), DOT_FP32)
    return p, p * (dp - delta[:, None])


@triton.jit
def _stats_kernel(
    Q, K, V, DO, OUT, LSE, DELTA, CU,
    s_qt, s_qh, s_kt, s_kh, s_ot, s_oh,
    qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_FP32: tl.constexpr,
    STORE_O: tl.constexpr,
):  # fmt: skip
    # STORE_O: write the fp32 output to OUT; else write delta = rowsum(dO * o) to DELTA (dO rows strided as q's).
    mb, seq, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length = _sequence(CU, seq)
    m0 = mb * BM
    if m0 >= length:
        return
    rows = m0 + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    dims = tl.arange(0, D)
    kvh = h // GROUP
    row_ok = rows < length
    q = _tile(Q, start, rows, row_ok, s_qt, h, s_qh, dims, DOT_FP32, Q.dtype.element_ty)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n0 in range(0, tl.minimum(length, m0 + BM), BN):
        keys = n0 + cols
        key_ok = keys < length
        k = _tile(K, start, keys, key_ok, s_kt, kvh, s_kh, dims, DOT_FP32, Q.dtype.element_ty)
        v = _tile(V, start, keys, key_ok, s_kt, kvh, s_kh, dims, DOT_FP32, Q.dtype.element_ty)
        s = _dot(q, tl.trans(k), DOT_FP32) * qk_scale
        s = tl.where((keys[None, :] <= rows[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(_operand(p, DOT_FP32, Q.dtype.element_ty), v, DOT_FP32)
        m_i = m_new
    o = acc / l_i[:, None]
    if STORE_O:
        tl.store(OUT + (start + rows)[:, None] * s_ot + h * s_oh + dims[None, :], o, mask=row_ok[:, None])
    else:
        do = tl.load(DO + (start + rows)[:, None] * s_qt + h * s_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
        tl.store(DELTA + (start + rows) * (s_qt // s_qh) + h, tl.sum(do.to(tl.float32) * o, 1), mask=row_ok)
    tl.store(LSE + (start + rows) * (s_qt // s_qh) + h, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU,
    s_qt, s_qh, s_kt, s_kh, s_dkt, s_dkh,
    qk_scale, sm_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    nb, seq, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length = _sequence(CU, seq)
    n0 = nb * BN
    if n0 >= length:
        return
    keys = n0 + tl.arange(0, BN)
    key_ok = keys < length
    dims = tl.arange(0, D)
    k = _tile(K, start, keys, key_ok, s_kt, kvh, s_kh, dims, DOT_FP32, Q.dtype.element_ty)
    v = _tile(V, start, keys, key_ok, s_kt, kvh, s_kh, dims, DOT_FP32, Q.dtype.element_ty)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    heads = s_qt // s_qh
    for g in range(GROUP):
        h = kvh * GROUP + g
        for m0 in range((n0 // BM) * BM, length, BM):
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < length
            q = _tile(Q, start, rows, row_ok, s_qt, h, s_qh, dims, DOT_FP32, Q.dtype.element_ty)
            do = _tile(DO, start, rows, row_ok, s_qt, h, s_qh, dims, DOT_FP32, Q.dtype.element_ty)
            lse = tl.load(LSE + (start + rows) * heads + h, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + (start + rows) * heads + h, mask=row_ok, other=0.0)
            p, ds = _probs_and_score_grads(q, k, v, do, lse, delta, rows, keys, row_ok, key_ok, qk_scale, DOT_FP32)
            dv += _dot(tl.trans(_operand(p, DOT_FP32, Q.dtype.element_ty)), do, DOT_FP32)
            dk += _dot(tl.trans(_operand(ds, DOT_FP32, Q.dtype.element_ty)), q, DOT_FP32)
    out_off = (start + keys)[:, None] * s_dkt + kvh * s_dkh + dims[None, :]
    tl.store(DK + out_off, dk * sm_scale, mask=key_ok[:, None])
    tl.store(DV + out_off, dv, mask=key_ok[:, None])


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU,
    s_qt, s_qh, s_kt, s_kh,
    qk_scale, sm_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    mb, seq, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length = _sequence(CU, seq)
    m0 = mb * BM
    if m0 >= length:
        return
    rows = m0 + tl.arange(0, BM)
    row_ok = rows < length
    cols = tl.arange(0, BN)
    dims = tl.arange(0, D)
    kvh = h // GROUP
    heads = s_qt // s_qh
    q = _tile(Q, start, rows, row_ok, s_qt, h, s_qh, dims, DOT_FP32, Q.dtype.element_ty)
    do = _tile(DO, start, rows, row_ok, s_qt, h, s_qh, dims, DOT_FP32, Q.dtype.element_ty)
    lse = tl.load(LSE + (start + rows) * heads + h, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + (start + rows) * heads + h, mask=row_ok, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    for n0 in range(0, tl.minimum(length, m0 + BM), BN):
        keys = n0 + cols
        key_ok = keys < length
        k = _tile(K, start, keys, key_ok, s_kt, kvh, s_kh, dims, DOT_FP32, Q.dtype.element_ty)
        v = _tile(V, start, keys, key_ok, s_kt, kvh, s_kh, dims, DOT_FP32, Q.dtype.element_ty)
        _, ds = _probs_and_score_grads(q, k, v, do, lse, delta, rows, keys, row_ok, key_ok, qk_scale, DOT_FP32)
        dq += _dot(_operand(ds, DOT_FP32, Q.dtype.element_ty), k, DOT_FP32)
    tl.store(DQ + (start + rows)[:, None] * s_qt + h * s_qh + dims[None, :], dq * sm_scale, mask=row_ok[:, None])


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float,
    gate: torch.Tensor | None = None,
    tiles: BackwardTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients ``(dq, dk, dv, dgate)`` of ``out = causal_attention(q, k, v) * sigmoid(gate)`` over packed
    sequences (q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, gate ``[T, Hq, D or 1]`` or None) given ``grad_out``.
    Gradients come back in their inputs' dtypes; ``max_len`` is the longest sequence (host int). ``tiles``: the
    kernels' launches, by default :func:`backward_tiles`."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads or d & (d - 1) or d < 16:
        raise ValueError(
            f"attention backward: Hq={heads} must be a multiple of Hkv={kv_heads}, D={d} a power of two >= 16"
        )
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    nseq = cu.numel() - 1
    group = heads // kv_heads
    qk_scale = scale * LOG2E
    dot_fp32 = _INTERPRET or q.dtype == torch.float32
    grad_out = grad_out.contiguous()  # the statistics kernel reads it with q's strides
    # With a gate the fp32 output is kept for the gate's gradient; without one the kernel reduces it into delta.
    gated = gate is not None
    o = torch.empty(t, heads, d, dtype=torch.float32, device=q.device) if gated else None
    lse = torch.empty(t, heads, dtype=torch.float32, device=q.device)
    delta = None if gated else torch.empty(t, heads, dtype=torch.float32, device=q.device)
    tiles = backward_tiles(q.dtype, d) if tiles is None else tiles
    common = dict(GROUP=group, D=d, DOT_FP32=dot_fp32)
    if q.dtype == torch.float32:
        common["maxnreg"] = FP32_MAXNREG

    def launch(tile: BackwardTile, blocks_of: int) -> tuple[int, dict[str, object]]:
        """The grid's first dimension (``blocks_of`` rows per block) and the launch's tile options."""
        n = triton.cdiv(max(max_len, 1), blocks_of)
        opts = dict(BM=tile.block_m, BN=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages)
        return n, {**opts, **common}

    if t and nseq:
        n, opts = launch(tiles.stats, tiles.stats.block_m)
        # lse stands in for the pointer the kernel leaves unused (OUT without a gate, DELTA with one)
        _stats_kernel[(n, nseq, heads)](
            q, k, v, grad_out, o if gated else lse, lse, lse if gated else delta, cu, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), heads * d, d, qk_scale, STORE_O=gated, **opts,
        )  # fmt: skip
    dgate = None
    if gated:
        g_out = grad_out.float()
        sig = torch.sigmoid(gate.float())
        dgate_full = g_out * o * sig * (1.0 - sig)
        dgate = (dgate_full.sum(-1, keepdim=True) if gate.shape[-1] == 1 else dgate_full).to(gate.dtype)
        g_out = g_out * sig
        delta = (g_out * o).sum(-1)
        do = g_out.to(q.dtype).contiguous()
    else:
        do = grad_out.to(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if t and nseq:
        n, opts = launch(tiles.dkdv, tiles.dkdv.block_n)
        _dkdv_kernel[(n, nseq, kv_heads)](
            q, k, v, do, lse, delta, dk, dv, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            dk.stride(0), dk.stride(1), qk_scale, scale, **opts,
        )  # fmt: skip
        n, opts = launch(tiles.dq, tiles.dq.block_m)
        _dq_kernel[(n, nseq, heads)](
            q, k, v, do, lse, delta, dq, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qk_scale, scale, **opts,
        )  # fmt: skip
    return dq, dk, dv, dgate
