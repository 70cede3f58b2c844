"""Entropy partials of vocab leaves in one pass (Triton); see :mod:`megatron_iso.ops.logprob.entropy`.

One program per (row, leaf) walks the leaf once in BLOCK-wide slices from the leaf's first entry, each lane
keeping an online max ``m``, ``s = sum exp(z - m)`` and ``u = sum exp(z - m) * z`` of ``z = logits /
temperature`` (div_rn's bits, skipped at temperature 1); the lanes are then combined into the leaf's ``(m, s, u)``.
A leaf's partials depend on its values alone (not on the shard holding it or the rows beside it), and there are
no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.logprob.temperature_triton import division_args, scale_by_temperature

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _entropy_partials_kernel(
    x_ptr, t_ptr, recip, recip_lo, out_ptr, LEAF, VALID, FIRST, stride_row,
    BLOCK: tl.constexpr, FAST_DIV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    leaf = tl.program_id(1)
    base = x_ptr + row * stride_row + leaf * LEAF
    first = FIRST + leaf * LEAF  # global id of the leaf's first entry
    temp = tl.load(t_ptr + row)
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    u = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, LEAF, BLOCK):
        idx = start + offs
        ok = (idx < LEAF) & (first + idx < VALID)
        x = tl.load(base + idx, mask=ok, other=1.0)  # 1, not 0: a masked lane must not make the slice divide
        z = scale_by_temperature(x.to(tl.float32), temp, recip, recip_lo, FAST_DIV)
        z = tl.where(ok, z, float("-inf"))
        # One exp per element, not two: where z raises the lane's max, z's own term is exp(0) = 1 and the sums
        # rescale by exp(m - z); elsewhere the sums stay and z adds exp(z - m). A -inf z (a masked lane or a -inf
        # logit) adds nothing: its exp is exp(-inf) = 0 and its u term 0 * 0, never 0 * -inf.
        up = z > m
        inf_z = z == float("-inf")
        e = tl.exp(tl.where(up, m - z, tl.where(inf_z, float("-inf"), z - m)))
        s = tl.where(up, s * e + 1.0, s + e)
        u = tl.where(up, u * e + z, u + e * tl.where(inf_z, 0.0, z))
        m = tl.maximum(m, z)
    row_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max))
    out = out_ptr + (row * tl.num_programs(1) + leaf) * 3
    tl.store(out, row_max)
    tl.store(out + 1, tl.sum(s * w, axis=0))
    tl.store(out + 2, tl.sum(u * w, axis=0))


def entropy_partials_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    leaves: int,
    valid: int,
    first: int,
    *,
    scalar_temperature: float | None = None,
) -> torch.Tensor:
    """``[rows, leaves, 3]`` fp32 ``(m, s, u)`` of each leaf of each row of ``logits [rows, V_shard]`` (the shard
    cut into ``leaves`` equal leaves); ``temperature [rows]`` fp32; global ids ``first + j`` at or past ``valid``
    masked. ``scalar_temperature``: the Python number every row's temperature came from, if one did (the kernel
    may then divide by a device-checked reciprocal, ``temperature_triton``: the same bits)."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, shard = x.shape
    out = torch.empty((rows, leaves, 3), device=x.device, dtype=torch.float32)
    if rows:
        recip, recip_lo, fast = division_args(scalar_temperature, x.dtype, x.device)
        _entropy_partials_kernel[(rows, leaves)](
            x, temperature, recip, recip_lo, out, shard // leaves, valid, first, x.stride(0),
            BLOCK=BLOCK, FAST_DIV=fast, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


__all__ = ["entropy_partials_triton"]
