"""``tl.exp``'s bits over a slice of a vocab pass, without the subnormal fix-up where no element of the slice needs it.

Triton lowers an fp32 ``tl.exp(d)`` to ``ex2.approx.f32(y)`` with ``y = d * log2(e)`` (the constant rounded to
fp32). PTX's non-flushing ``ex2.approx.f32`` compiles to one MUFU.EX2 plus a fix-up for results below the normal
range: a compare of ``y`` with -126, then a halving of ``y`` before and a squaring of the result after, both under the
compare's predicate. That is three issue slots per element whether or not the predicate holds, as many as the
subtraction, multiply and MUFU.EX2 themselves. For ``y >= -126`` the fix-up changes nothing: the result is MUFU.EX2's,
which is all that the flushing ``ex2.approx.ftz.f32`` compiles to.

In the vocab passes ``d = z - m <= 0``, and most slices have every ``y`` far above -126 (logits within 87 of the
running max). Subtraction and a multiply by a positive constant are monotone, so the slice's least ``y`` is
``RN(RN(min(z) - m) * log2(e))``: one extra min per element decides for the whole slice (a per-slice branch, uniform
across the program, never a per-element select), and the bits are ``tl.exp``'s either way.
tests/gpu/test_triton_ops.py checks on the device that the two instructions agree on every fp32 ``y`` in
``[-126, 0]`` and that ``tl.exp`` is ``ex2.approx.f32`` of that product.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Triton's fp32 exp multiplies by log2(e) before ex2; the same literal becomes the same fp32 constant here.
LOG2E = tl.constexpr(1.4426950408889634)
# The least ex2 input whose result is normal: at and above it the fix-up of ex2.approx.f32 does nothing.
EX2_NORMAL_MIN = tl.constexpr(-126.0)


@triton.jit
def ex2_ftz(y):
    """``ex2.approx.ftz.f32``: MUFU.EX2 alone (equal to ``ex2.approx.f32`` for ``y >= -126``)."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [y], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def slice_exp(d, d_min, ASM: tl.constexpr):
    """``tl.exp(d)``, bit for bit, for fp32 ``d`` whose least element is ``d_min`` (a scalar; NaN takes ``tl.exp``).
    ``ASM`` False (the interpreter, which has no inline asm): ``tl.exp`` always."""
    # Branches, not a select, and tl.exp only inside them: a select, or an exp computed first, pays for both.
    if ASM:
        if d_min * LOG2E >= EX2_NORMAL_MIN:  # noqa: SIM108
            e = ex2_ftz(d * LOG2E)
        else:
            e = tl.exp(d)
    else:
        e = tl.exp(d)
    return e


__all__ = ["EX2_NORMAL_MIN", "LOG2E", "ex2_ftz", "slice_exp"]
