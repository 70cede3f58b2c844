"""The float64 constants of the IEEE-composed math functions, shared by the torch chains
(``ieee_math``) and their Triton twins (``ieee_math_triton``): one Python expression per constant, so
both sides hold the same doubles."""

from __future__ import annotations

import math

# ln 2 split so that k * LN2_HI is exact for |k| < 2^21 (its low bits are zero).
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.0 / math.log(2.0)
# Taylor coefficients 1/n! for n = 0..12; |r| <= ln2/2 makes the truncation error ~1.6e-16.
EXP_COEFFS = [1.0 / math.factorial(n) for n in range(13)]
# exp64 clamps its argument so that 2^k stays a normal float64 (no inf*0 or subnormal scaling).
EXP_MIN, EXP_MAX = -708.0, 709.0

# log(m) for m in [sqrt(1/2), sqrt(2)) as 2*atanh(s), s = (m-1)/(m+1), |s| < 0.172: s^(2n+1)/(2n+1) drops
# below 1e-17 by n = 11.
ATANH_TERMS = 12
LN2 = math.log(2.0)
SQRT2 = math.sqrt(2.0)

# pi/2 = PIO2_HI + PIO2_LO, with PIO2_HI's low 20 bits zero: k * PIO2_HI is exact for k < 2^20
# (angles up to ~1.6e6 rad). Same split as fdlibm's pio2_1.
PIO2_HI = 1.57079632673412561417e00
PIO2_LO = 6.07710050650619224932e-11
TWO_OVER_PI = 2.0 / math.pi
# Taylor terms up to x^17 / x^16 on |r| <= pi/4: truncation error < 1e-16.
SIN_COEFFS = [(-1.0) ** n / math.factorial(2 * n + 1) for n in range(9)]
COS_COEFFS = [(-1.0) ** n / math.factorial(2 * n) for n in range(9)]
# The largest angle the two-part reduction keeps exact.
MAX_ANGLE = float(2**20) * PIO2_HI
