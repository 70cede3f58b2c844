"""The Gumbel-max draw as one Triton kernel: each program scans a slice of one row's vocab.

Per token: Philox-4x32-10 word 0 of (counter = (token id, GUMBEL_STREAM, 0, 0), key = the row's key),
u = ((word >> 8) + 1/2) * 2^-24, noise -log(-log u) through the float64 ``log64`` twin, score =
float64(logit / T) + noise (greedy rows: no noise). The program keeps its slice's best score and the lowest
id reaching it; :func:`megatron_iso.inference.sampler.gumbel_tokens` picks the row's winner over slices. Every
operation is correctly rounded and FMA contraction is off, so the scores are the reference's
(:func:`~megatron_iso.inference.sampler.gumbel_partials_reference`) bit for bit, and a row's winner depends
on that row alone, whatever the split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.inference.rng import GUMBEL_STREAM
from megatron_iso.ops.common.ieee_math_triton import NO_FMA, log64, neg

_M0 = tl.constexpr(0xD2511F53)
_M1 = tl.constexpr(0xCD9E8D57)
_W0 = tl.constexpr(0x9E3779B9)
_W1 = tl.constexpr(0xBB67AE85)
_STREAM = tl.constexpr(GUMBEL_STREAM)
_TWO_M24 = tl.constexpr(2.0**-24)
BLOCK = 1024


@triton.jit
def philox_word0(c0, k0, k1):
    """Word 0 of Philox-4x32-10 with counter (c0, STREAM, 0, 0) and key (k0, k1), all uint32."""
    c1 = tl.full(c0.shape, _STREAM, tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    m0 = tl.full(c0.shape, _M0, tl.uint32)
    m1 = tl.full(c0.shape, _M1, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0 = tl.umulhi(c0, m0)
        lo0 = c0 * m0
        hi1 = tl.umulhi(c2, m1)
        lo1 = c2 * m1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0


@triton.jit
def _gumbel_partial_kernel(
    logits_ptr, stride_row, keys_ptr, temp_ptr, greedy_ptr, best_ptr, best_id_ptr,
    n_local, id_offset, valid_vocab, per_split, n_split,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * per_split
    end = tl.minimum(start + per_split, n_local)
    k0 = tl.load(keys_ptr + row * 2).to(tl.uint32)
    k1 = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
    temp = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    best = tl.full([], float("-inf"), tl.float64)
    best_id = (id_offset + n_local).to(tl.int64)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    for off in range(start, end, BLOCK):
        local = off + tl.arange(0, BLOCK)
        ids = local.to(tl.int64) + id_offset
        live = (local < end) & (ids < valid_vocab)
        z = tl.load(row_ptr + local, mask=live, other=0.0).to(tl.float32)
        scaled = tl.math.div_rn(z, temp).to(tl.float64)  # the default division is approximate
        word = philox_word0(ids.to(tl.uint32), k0, k1)
        u = ((word >> 8).to(tl.float64) + 0.5) * _TWO_M24
        noise = neg(log64(neg(log64(u))))
        s = tl.where(greedy, scaled, scaled + noise)
        s = tl.where(live & (s == s), s, -float("inf"))  # NaN scores never win
        m = tl.max(s, axis=0)
        m_id = tl.min(tl.where(s == m, ids, id_offset + n_local), axis=0)
        take = m > best  # an earlier tile holds lower ids: it keeps ties
        best_id = tl.where(take, m_id, best_id)
        best = tl.where(take, m, best)
    tl.store(best_ptr + row * n_split + split, best)
    tl.store(best_id_ptr + row * n_split + split, best_id)


def gumbel_partials_triton(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    *,
    id_offset: int,
    valid_vocab: int,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and vocab slice: the best score (float64) and the lowest token id reaching it (int64).

    ``logits [R, V_local]`` (any float dtype, rows contiguous), ``keys [R, 2]`` int64 row keys, ``temperature
    [R]`` fp32 (> 0), ``greedy [R]`` bool. A slice with no live token reports -inf and id ``id_offset + V_local``.
    """
    rows, n_local = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if splits is None:  # enough programs to keep every SM busy at small row counts
        splits = max(1, min(triton.cdiv(n_local, 8 * BLOCK), triton.cdiv(512, max(rows, 1))))
    per_split = triton.cdiv(triton.cdiv(n_local, splits), BLOCK) * BLOCK
    splits = triton.cdiv(n_local, per_split)
    best = torch.empty((rows, splits), dtype=torch.float64, device=logits.device)
    best_id = torch.empty((rows, splits), dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_partial_kernel[(rows, splits)](
            logits, logits.stride(0), keys.contiguous(), temperature.float().contiguous(),
            greedy.to(torch.int8).contiguous(), best, best_id, n_local, id_offset, valid_vocab, per_split, splits,
            BLOCK=BLOCK, num_warps=4, **NO_FMA,
        )  # fmt: skip
    return best, best_id
