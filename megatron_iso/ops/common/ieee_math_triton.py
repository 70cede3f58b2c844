"""Triton twins of ``ieee_math``'s IEEE-composed float64 functions, for use inside other kernels.

Each helper performs the torch reference's float64 operations in the same order, and every one of
them is correctly rounded (``+ - * /``, compares, selects, bit manipulation), so a kernel built from
them returns the reference's bits, provided it is compiled with ``enable_fp_fusion=False`` (pass
:data:`NO_FMA` at launch). With fusion on, LLVM/ptxas contract ``p * r + c`` into one FMA with a
single rounding and the Horner steps drift from the two-rounding torch sequence in the last bit.

Constants come from the reference modules themselves (same Python expressions, same doubles). A
float literal meeting a float64 tensor becomes a float64 constant in Triton (the scalar is created
in the promoted type), so nothing here is rounded through float32.

Rounding to the nearest integer, ties to even (``torch.round``), uses the add/subtract of
``1.5 * 2^52``: for ``|y| < 2^51`` the sum lands where the float64 spacing is 1, so the addition
itself rounds ``y`` half-to-even, and the subtraction is exact. The interpreter has no libdevice,
so ``rint`` is not an option for code that must also run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common import ieee_constants as _k

# Launch option for every kernel that uses these helpers: no FMA contraction (see the module doc).
NO_FMA = {"enable_fp_fusion": False}

_RNE_MAGIC = tl.constexpr(6755399441055744.0)  # 1.5 * 2^52

_LN2_HI = tl.constexpr(_k.LN2_HI)
_LN2_LO = tl.constexpr(_k.LN2_LO)
_INV_LN2 = tl.constexpr(_k.INV_LN2)
_EXP_MIN = tl.constexpr(_k.EXP_MIN)
_EXP_MAX = tl.constexpr(_k.EXP_MAX)
_E = [tl.constexpr(c) for c in _k.EXP_COEFFS]
_E0, _E1, _E2, _E3, _E4, _E5, _E6, _E7, _E8, _E9, _E10, _E11, _E12 = _E

_PIO2_HI = tl.constexpr(_k.PIO2_HI)
_PIO2_LO = tl.constexpr(_k.PIO2_LO)
_TWO_OVER_PI = tl.constexpr(_k.TWO_OVER_PI)
_S0, _S1, _S2, _S3, _S4, _S5, _S6, _S7, _S8 = [tl.constexpr(c) for c in _k.SIN_COEFFS]
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8 = [tl.constexpr(c) for c in _k.COS_COEFFS]

if len(_k.EXP_COEFFS) != 13 or len(_k.SIN_COEFFS) != 9 or len(_k.COS_COEFFS) != 9:
    # The Horner chains below are written out term by term; a changed reference must change them too.
    raise ImportError("ieee_math_triton: the reference polynomial degrees changed; update the Triton Horner chains")


@triton.jit
def neg(x):
    """``-x`` as torch computes it (sign flip). Triton's unary minus is ``0 - x``, which maps +0.0 to +0.0;
    multiplying by -1 is exact and flips the sign of zeros too."""
    return x * -1.0


@triton.jit
def f32_to_bf16(y):
    """float32 -> bfloat16, round half to even (torch's rounding), done on the bits.

    Same result as the hardware ``cvt.rn.bf16.f32`` on a GPU; spelled out because the interpreter's
    cast truncates, which would make the ``TRITON_INTERPRET=1`` bitwise tests meaningless for bf16.
    """
    b = y.to(tl.uint32, bitcast=True)
    r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
    r = tl.where(y != y, (b >> 16) | 0x40, r)  # NaN stays a (quiet) NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_f32(x):
    """``x`` (float32, bfloat16 or float16) widened to float32, exactly. bfloat16 goes through its bits
    (the upper half of a float32): the interpreter's own cast mishandles bfloat16 subnormals."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def f32_to(y, dtype: tl.constexpr):
    """float32 ``y`` rounded to ``dtype`` (float32, bfloat16 or float16) to nearest, ties to even."""
    if dtype == tl.bfloat16:
        return f32_to_bf16(y)
    else:
        return y.to(dtype)


@triton.jit
def round_half_even64(y):
    """``torch.round`` of float64 ``|y| < 2^51`` (ties to even); a zero result keeps ``y``'s sign like rint."""
    k = (y + _RNE_MAGIC) - _RNE_MAGIC
    # rint(-0.3) is -0.0; the magic sum gives +0.0. y * 0.0 is a zero with y's sign.
    return tl.where(k == 0.0, y * 0.0, k)


@triton.jit
def pow2_64(k):
    """``2^k`` for an integral float64 ``k`` in the normal range, built from the bit pattern (exact)."""
    ki = tl.where(k != k, 0.0, k).to(tl.int64)  # NaN -> 0, as torch.nan_to_num in the reference
    return ((ki + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def exp64(x):
    """``ieee_math.exp64``: clamp to [-708, 709], k = round(x / ln2), Cody-Waite r, Horner deg 12, * 2^k."""
    # torch.clamp propagates NaN; compares with NaN are false, so these selects keep it too.
    x = tl.where(x < _EXP_MIN, _EXP_MIN, x)
    x = tl.where(x > _EXP_MAX, _EXP_MAX, x)
    k = round_half_even64(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = r * _E12 + _E11  # full_like(r, c12) * r == c12 * r, bit for bit (multiplication commutes)
    p = p * r + _E10
    p = p * r + _E9
    p = p * r + _E8
    p = p * r + _E7
    p = p * r + _E6
    p = p * r + _E5
    p = p * r + _E4
    p = p * r + _E3
    p = p * r + _E2
    p = p * r + _E1
    p = p * r + _E0
    return p * pow2_64(k)


@triton.jit
def sigmoid64(x):
    """``ieee_math.sigmoid64``: ``1 / (1 + exp64(-x))`` (float64 division is IEEE div.rn)."""
    return 1.0 / (1.0 + exp64(neg(x)))


@triton.jit
def silu64(x):
    """``x * sigmoid64(x)`` in float64 (as ``ieee_math.iso_silu`` before its rounding)."""
    return x * sigmoid64(x)


@triton.jit
def sincos64(angle):
    """``ieee_math.sincos64``: (sin, cos) of a float64 angle, |angle| within the exact reduction range."""
    k = round_half_even64(angle * _TWO_OVER_PI)
    r = (angle - k * _PIO2_HI) - k * _PIO2_LO
    r2 = r * r
    ps = r2 * _S8 + _S7
    ps = ps * r2 + _S6
    ps = ps * r2 + _S5
    ps = ps * r2 + _S4
    ps = ps * r2 + _S3
    ps = ps * r2 + _S2
    ps = ps * r2 + _S1
    ps = ps * r2 + _S0
    s = r * ps
    c = r2 * _C8 + _C7
    c = c * r2 + _C6
    c = c * r2 + _C5
    c = c * r2 + _C4
    c = c * r2 + _C3
    c = c * r2 + _C2
    c = c * r2 + _C1
    c = c * r2 + _C0
    # torch's remainder(k, 4) is in 0..3 for negative k too; & 3 on two's complement is the same.
    q = k.to(tl.int64) & 3
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, neg(s), neg(c))))
    cos = tl.where(q == 0, c, tl.where(q == 1, neg(s), tl.where(q == 2, neg(c), s)))
    return sin, cos


_SQRT2 = tl.constexpr(_k.SQRT2)
_LN2 = tl.constexpr(_k.LN2)
# The atanh series' coefficients 1 / (2n + 1), as the reference computes them (Python doubles).
_A = [tl.constexpr(1.0 / (2 * n + 1)) for n in range(_k.ATANH_TERMS)]
_A0, _A1, _A2, _A3, _A4, _A5, _A6, _A7, _A8, _A9, _A10, _A11 = _A


@triton.jit
def log64(x):
    """``ieee_math.log64`` for positive normal float64 ``x``: exact exponent split from the bits, mantissa
    moved into [sqrt(2)/2, sqrt(2)), atanh series of degree 23 in s = (m - 1) / (m + 1)."""
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0x000FFFFFFFFFFFFF) | (1023 << 52)).to(tl.float64, bitcast=True)
    big = m > tl.full([], _SQRT2, tl.float64)  # a bare constexpr would be compared as float32
    m = tl.where(big, m * 0.5, m)
    e = (e + big.to(tl.int64)).to(tl.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = s2 * _A11 + _A10
    p = p * s2 + _A9
    p = p * s2 + _A8
    p = p * s2 + _A7
    p = p * s2 + _A6
    p = p * s2 + _A5
    p = p * s2 + _A4
    p = p * s2 + _A3
    p = p * s2 + _A2
    p = p * s2 + _A1
    p = p * s2 + _A0
    return e * _LN2 + 2.0 * s * p


_EVAL64 = {"exp64": 0, "sigmoid64": 1, "silu64": 2, "sin64": 3, "cos64": 4, "log64": 5}


@triton.jit
def _eval64_kernel(x_ptr, y_ptr, N, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if FN == 0:
        y = exp64(x)
    elif FN == 1:
        y = sigmoid64(x)
    elif FN == 2:
        y = silu64(x)
    elif FN == 3:
        y, _c = sincos64(x)
    elif FN == 4:
        _s, y = sincos64(x)
    else:
        y = log64(x)
    tl.store(y_ptr + offs, y, mask=mask)


_ISO = {"exp": 0, "sigmoid": 1}
# Inputs the one-launch iso_exp / iso_sigmoid take; float64 inputs stay on the torch chain.
ISO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _iso_kernel(x_ptr, y_ptr, N, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = to_f32(tl.load(x_ptr + offs, mask=mask, other=0.0)).to(tl.float64)  # x.double(): exact widenings
    if FN == 0:  # noqa: SIM108 - a constexpr branch: Triton compiles only the chosen one
        y = exp64(x)
    else:
        y = sigmoid64(x)
    tl.store(y_ptr + offs, y.to(tl.float32), mask=mask)  # .float(): one rounding, to nearest even


def iso_eval(name: str, x: torch.Tensor) -> torch.Tensor:
    """``ieee_math.iso_exp`` / ``iso_sigmoid`` of a float32/bfloat16/float16 tensor in one launch: float32
    result with the torch chain's bits (the same float64 operations, FMA contraction off)."""
    if name not in _ISO:
        raise ValueError(f"iso_eval: name={name!r}, allowed {sorted(_ISO)}")
    if x.dtype not in ISO_DTYPES:
        raise TypeError(f"iso_eval: dtype {x.dtype} not supported; supported {ISO_DTYPES}")
    flat = x.reshape(-1).contiguous()
    y = torch.empty(flat.shape, dtype=torch.float32, device=x.device)
    if flat.numel():
        block = 1024
        _iso_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, y, flat.numel(), FN=_ISO[name], BLOCK=block, num_warps=4, **NO_FMA
        )
    return y.reshape(x.shape)


def eval64(name: str, x: torch.Tensor) -> torch.Tensor:
    """One helper applied elementwise to a float64 tensor (``name`` in ``exp64, sigmoid64, silu64, sin64,
    cos64, log64``): the helpers' own float64 bits, checked against ``ieee_math``/``rope.reference`` by the tests."""
    if name not in _EVAL64:
        raise ValueError(f"eval64: name={name!r}, allowed {sorted(_EVAL64)}")
    if x.dtype != torch.float64:
        raise TypeError(f"eval64 expects float64, got {x.dtype}")
    flat = x.reshape(-1).contiguous()
    y = torch.empty_like(flat)
    if flat.numel():
        block = 1024
        _eval64_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, y, flat.numel(), FN=_EVAL64[name], BLOCK=block, num_warps=4, **NO_FMA
        )
    return y.reshape(x.shape)
