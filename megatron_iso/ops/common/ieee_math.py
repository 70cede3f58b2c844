"""Transcendental functions built only from correctly rounded IEEE operations.

Why this exists: ATen's CPU elementwise kernels run a vectorised body and a scalar tail, and for
some functions the two disagree in the last bit (measured on torch 2.13, AVX2: ``torch.sigmoid``
and ``F.silu`` differ for ~4% of fp32 inputs between a 1-element call and a long-tensor call).
Which lane an element lands in depends on the tensor's shape, so a decode step (1 row) and a
training forward (N rows) would round differently. ``+ - * /``, ``sqrt``, ``round``, comparisons
and ``where`` are exact or correctly rounded in every lane, so functions composed only of them give
the same bits for an element whatever the shape, the thread split, or (as a bonus) the CPU.

The reference path computes in float64 and rounds the result to float32 once; the polynomial
error (~1e-16 relative) is far below float32 resolution, so results are faithful float32 values.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.common.ieee_constants import (
    ATANH_TERMS,
    COS_COEFFS,
    EXP_COEFFS,
    EXP_MAX,
    EXP_MIN,
    INV_LN2,
    LN2,
    LN2_HI,
    LN2_LO,
    PIO2_HI,
    PIO2_LO,
    SIN_COEFFS,
    SQRT2,
    TWO_OVER_PI,
)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor from range reduction + polynomial; inputs clamped to [-708, 709]."""
    if x.dtype != torch.float64:
        raise TypeError(f"exp64 expects float64, got {x.dtype}")
    x = x.clamp(EXP_MIN, EXP_MAX)
    k = torch.round(x * INV_LN2)  # round half to even: exact
    r = (x - k * LN2_HI) - k * LN2_LO
    p = torch.full_like(r, EXP_COEFFS[-1])
    for c in reversed(EXP_COEFFS[:-1]):
        p = p * r + c
    # 2^k built from its bit pattern: exact, no pow() whose vector/scalar lanes might differ.
    # A NaN input gives a meaningless k, but p is NaN and NaN * anything is NaN.
    ki = torch.nan_to_num(k, nan=0.0).to(torch.int64)
    two_k = ((ki + 1023) << 52).view(torch.float64)
    return p * two_k


def sigmoid64(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in float64."""
    return 1.0 / (1.0 + exp64(-x))


def _exp_chain(x: torch.Tensor) -> torch.Tensor:
    return exp64(x.double()).float()


def _sigmoid_chain(x: torch.Tensor) -> torch.Tensor:
    return sigmoid64(x.double()).float()


def _on_device(name: str, chain, x: torch.Tensor) -> torch.Tensor:
    """On CUDA, one Triton launch with the chain's bits instead of ~30 torch launches (the MoE router,
    the shared-expert gate and the sampler call these per layer or per step); gradients stay the
    chain's (``with_plain_backward``). Elsewhere, and for float64 inputs, the torch chain itself."""
    if not x.is_cuda:
        return chain(x)
    from megatron_iso.ops.common import ieee_math_triton  # triton ships with every CUDA torch

    if x.dtype not in ieee_math_triton.ISO_DTYPES:
        return chain(x)
    return with_plain_backward(lambda t: ieee_math_triton.iso_eval(name, t), chain, x)


def iso_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) as float32, computed in float64 and rounded once; same bits for any shape and device."""
    return _on_device("exp", _exp_chain, x)


def iso_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) as float32, computed in float64 and rounded once; same bits for any shape and device."""
    return _on_device("sigmoid", _sigmoid_chain, x)


def iso_silu(x: torch.Tensor) -> torch.Tensor:
    """silu(x) = x * sigmoid(x) as float32, computed in float64 and rounded once."""
    x64 = x.double()
    return (x64 * sigmoid64(x64)).float()


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of a positive float64 tensor (normal numbers): exponent split off exactly, atanh series."""
    if x.dtype != torch.float64:
        raise TypeError(f"log64 expects float64, got {x.dtype}")
    # Exact frexp from the bit pattern: x = m * 2^e, m in [1, 2).
    bits = x.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0x000FFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # mantissa in [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)  # exact: a power-of-two scale
    e = (e + big.to(torch.int64)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, 1.0 / (2 * ATANH_TERMS - 1))
    for n in reversed(range(ATANH_TERMS - 1)):
        p = p * s2 + 1.0 / (2 * n + 1)
    return e * LN2 + 2.0 * s * p


def log1p64(y: torch.Tensor) -> torch.Tensor:
    """log(1 + y) for float64 y > -1, accurate for tiny y: log(u) * y / (u - 1) with u = fl(1 + y)."""
    u = 1.0 + y
    d = u - 1.0
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, y, log64(u) * (y / safe))


class _Softplus64(torch.autograd.Function):
    """The bit-level log split has no autograd path, so the derivative is given: d softplus = sigmoid."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.clamp_min(0.0) + log1p64(exp64(-x.abs()))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * sigmoid64(x)


def softplus64(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) in float64 as max(x, 0) + log1p(exp(-|x|)) (no overflow, no threshold switch)."""
    if x.dtype != torch.float64:
        raise TypeError(f"softplus64 expects float64, got {x.dtype}")
    return _Softplus64.apply(x)


def horner(coeffs: list[float], x: torch.Tensor) -> torch.Tensor:
    """sum(coeffs[n] * x**n) by Horner's rule, highest degree first: one rounding per step."""
    p = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * x + c
    return p


def sincos64(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) of a float64 angle: Cody-Waite reduction by pi/2 in two parts, Taylor polynomials on
    |r| <= pi/4, quadrant select. Exact reduction for |angle| <= ``ieee_constants.MAX_ANGLE``."""
    k = torch.round(angle * TWO_OVER_PI)
    r = (angle - k * PIO2_HI) - k * PIO2_LO
    r2 = r * r
    s = r * horner(SIN_COEFFS, r2)
    c = horner(COS_COEFFS, r2)
    quadrant = k.to(torch.int64).remainder(4)
    # sin(a) over quadrants 0..3: s, c, -s, -c;  cos(a): c, -s, -c, s.
    sin = torch.where(quadrant == 0, s, torch.where(quadrant == 1, c, torch.where(quadrant == 2, -s, -c)))
    cos = torch.where(quadrant == 0, c, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -c, s)))
    return sin, cos
