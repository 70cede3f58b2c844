"""Counter-based random numbers: Philox-4x32-10 written with int64 tensor ops.

A draw is a pure function of its key ``(seed)`` and counter ``(position, sample, request id)``:
no generator state, so a sequence's random numbers do not depend on which batch it ran in, when
it arrived, or how the scheduler split its steps. Only integer ops are used (products of 32-bit
words are split into 16-bit halves so nothing overflows int64), so CPU and GPU give the same
words; the uniform is ``(word >> 8) * 2**-24``, exact in fp32.
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
ROUNDS = 10


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` (a a 32-bit constant, b int64 words < 2**32)."""
    p_lo = b * (a & 0xFFFF)  # < 2**48
    p_hi = b * (a >> 16)  # < 2**48
    lo = (p_lo + ((p_hi & 0xFFFF) << 16)) & MASK32
    hi = ((p_hi + (p_lo >> 16)) >> 16) & MASK32
    return hi, lo


def philox4x32(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox-4x32-10: ``counter [..., 4]``, ``key [..., 2]`` (int64 holding 32-bit words) -> ``[..., 4]``."""
    if counter.shape[-1] != 4 or key.shape[-1] != 2:
        raise ValueError(f"philox4x32: counter [..., 4] and key [..., 2] expected, got {counter.shape}, {key.shape}")
    c0, c1, c2, c3 = (counter[..., i].long() & MASK32 for i in range(4))
    k0, k1 = (key[..., i].long() & MASK32 for i in range(2))
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + _W0) & MASK32, (k1 + _W1) & MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def request_key(request_id: int | str) -> int:
    """A request id as a 64-bit integer: ints as given (must fit), strings by a fixed hash (blake2b)."""
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        raise TypeError(f"request_id must be an int or str, got {type(request_id).__name__}")
    if isinstance(request_id, str):
        return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    if not 0 <= request_id < 1 << 64:
        raise ValueError(f"request_id={request_id} must be in [0, 2**64)")
    return request_id


def uniforms(
    seeds: torch.Tensor, request_keys: torch.Tensor, samples: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One fp32 uniform in [0, 1) per row, keyed by (seed, request id, sample index, position).

    All inputs are int64 tensors of one shape (seeds and request keys may use all 64 bits, stored
    as two's complement); the result has that shape.
    """
    seeds, request_keys = seeds.long(), request_keys.long()
    key = torch.stack((seeds & MASK32, (seeds >> 32) & MASK32), dim=-1)
    counter = torch.stack(
        (positions.long() & MASK32, samples.long() & MASK32, request_keys & MASK32, (request_keys >> 32) & MASK32),
        dim=-1,
    )
    word = philox4x32(counter, key)[..., 0]
    return (word >> 8).to(torch.float32) * (2.0**-24)


def as_int64(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (what a torch.int64 tensor holds)."""
    return value - (1 << 64) if value >= 1 << 63 else value
