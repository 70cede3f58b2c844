"""Logits divided by the temperature inside the vocab kernels: the IEEE quotient, at the cost of a multiply-add.

``z = fma(x, r_hi, x * r_lo)`` with ``1 / t`` split once on the host (``r_hi = RD(1 / t)``, ``r_lo > 0``) instead
of ``div_rn``. Invariant kept: the bits are ``div_rn``'s whichever form runs: :func:`reciprocal_for` checks the fast
form on the device against ``div_rn`` over every reachable 16-bit value before handing it out, slices with a logit
below :data:`TINY` divide, temperature tensors and powers of two divide, ``t == 1`` skips the division.

Design: docs/KERNELS.md, "Temperature division".
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

# Below this magnitude a logit's slice divides with div_rn: x * r_lo could be subnormal there, where the
# correction is not exact. 2^-60: far above any subnormal, far below any logit a model produces.
TINY = tl.constexpr(2.0**-60)
_CHECKED_DTYPES = (torch.bfloat16, torch.float16)
_CHECK_BLOCK = 1024


@triton.jit
def reciprocal_quotient(x, recip, recip_lo):
    """``x / t`` correctly rounded from ``recip = RD(1 / t)`` and ``recip_lo = RN(1 / t - recip)`` (valid where
    :func:`reciprocal_for` said so)."""
    return tl.fma(x, recip, x * recip_lo)


@triton.jit
def scale_by_temperature(x, temp, recip, recip_lo, FAST: tl.constexpr):
    """fp32 ``x / temp`` with div_rn's bits. ``FAST``: ``(recip, recip_lo)`` passed the device check for ``temp``;
    every row of the launch then has that temperature."""
    # Branches (if statements), not selects: a select would still divide.
    if temp == 1.0:
        z = x  # x / 1 is x exactly (signed zeros and infinities too)
    elif FAST:
        # One min per element (an fp32 min takes |x| as an operand modifier; on the packed 16-bit pairs the repacking
        # costs more): a slice holding a logit below TINY in magnitude, zeros included, divides. Zeros would pass the
        # fast form too, but excluding them costs two more operations per element, and a zero logit is rare (a masked
        # lane loads a non-zero placeholder for this reason).
        if tl.min(tl.abs(x)) < TINY:  # noqa: SIM108
            z = tl.math.div_rn(x, temp)
        else:
            z = reciprocal_quotient(x, recip, recip_lo)
    else:
        z = tl.math.div_rn(x, temp)
    return z


@triton.jit
def _division_check_kernel(out_ptr, temp, recip, recip_lo, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    # out[program] = how many 16-bit patterns of this block reach the fast form and get other bits than div_rn.
    bits = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int16)
    if IS_BF16:
        x = bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    reaches = (tl.abs(x) >= TINY) | (x != x)  # NaN: false against TINY, but the slice min skips it, so it reaches
    exact = tl.math.div_rn(x, temp).to(tl.int32, bitcast=True)
    fast = reciprocal_quotient(x, recip, recip_lo).to(tl.int32, bitcast=True)
    tl.store(out_ptr + tl.program_id(0), tl.sum((reaches & (exact != fast)).to(tl.int32), axis=0))


_VERDICTS: dict[tuple[int, torch.dtype, torch.device], bool] = {}


def reciprocal_for(
    temperature: float | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[float, float] | None:
    """``(RD(1 / t), RN(1 / t - RD(1 / t)))`` as Python floats when the kernels may use :func:`reciprocal_quotient`
    for logits of ``dtype`` at the Python-number temperature ``temperature`` on ``device``, else None (divide).

    The first call per (fp32 temperature, dtype, device) launches the check and reads its count back (one
    sync); later calls read the cached verdict. During CUDA-graph capture an unchecked temperature returns
    None rather than synchronising."""
    if isinstance(temperature, torch.Tensor) or dtype not in _CHECKED_DTYPES:
        return None
    t = np.float32(temperature)
    if t == 1 or not np.isfinite(t) or t <= 0:
        return None  # 1: no division at all; the rest is refused by checked_temperature before a launch
    inverse = 1.0 / float(t)  # float64: 1 / t to 2^-53
    recip = np.float32(inverse)
    if float(recip) > inverse:
        recip = np.nextafter(recip, np.float32(0))
    recip_lo = np.float32(inverse - float(recip))  # the float64 difference is exact (Sterbenz), then rounded
    if recip_lo == 0:
        return None  # an exact reciprocal (a power-of-two temperature): the kernels divide
    key = (int(t.view(np.int32)), dtype, torch.device(device))
    if key not in _VERDICTS:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        mismatches = torch.empty(65536 // _CHECK_BLOCK, dtype=torch.int32, device=device)
        _division_check_kernel[(mismatches.numel(),)](
            mismatches, float(t), float(recip), float(recip_lo), IS_BF16=dtype == torch.bfloat16, BLOCK=_CHECK_BLOCK
        )
        _VERDICTS[key] = int(mismatches.sum()) == 0
    return (float(recip), float(recip_lo)) if _VERDICTS[key] else None


def division_args(
    temperature: float | torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> tuple[float, float, bool]:
    """``(recip, recip_lo, FAST)``, the arguments of :func:`scale_by_temperature` a kernel launch passes: the checked
    pair from :func:`reciprocal_for` and True, or placeholders and False (divide). ``None``: no Python number."""
    pair = None if temperature is None else reciprocal_for(temperature, dtype, device)
    return (*pair, True) if pair is not None else (1.0, 0.0, False)


__all__ = ["TINY", "division_args", "reciprocal_for", "reciprocal_quotient", "scale_by_temperature"]
