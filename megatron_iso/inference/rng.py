"""Counter-based random numbers: Philox-4x32-10 on the host, in numpy uint64 words.

A draw is a pure function of its key ``(seed)`` and counter ``(position, sample, request id)``:
no generator state, so a sequence's random numbers do not depend on which batch it ran in, when
it arrived, or how the scheduler split its steps. Only integer ops are used (a product of two
32-bit words fits a uint64 exactly), so every machine gives the same words; the uniform is
``(word >> 8) * 2**-24``, exact in fp32. The engine draws one uniform (or one row key) per row per step on the host:
numpy's whole-array ops keep that at tens of microseconds (torch's per-op overhead made the same
~200 ops about 0.9 ms a step).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
ROUNDS = 10


def _words(t: torch.Tensor) -> np.ndarray:
    """Each int64 of ``t`` as the uint64 with the same bits (two's complement)."""
    return t.detach().cpu().long().numpy().view(np.uint64)


def _philox(c: list[np.ndarray], k0: np.ndarray, k1: np.ndarray) -> list[np.ndarray]:
    """Philox-4x32-10 on uint64 arrays holding 32-bit words: counter words ``c`` and key words ``k0, k1``."""
    mask, m0, m1 = np.uint64(MASK32), np.uint64(_M0), np.uint64(_M1)
    w0, w1, shift = np.uint64(_W0), np.uint64(_W1), np.uint64(32)
    c0, c1, c2, c3 = (w & mask for w in c)
    k0, k1 = k0 & mask, k1 & mask
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        p0, p1 = c0 * m0, c2 * m1  # < 2**64: exact
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & mask, (p0 >> shift) ^ c3 ^ k1, p0 & mask
    return [c0, c1, c2, c3]


def philox4x32(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox-4x32-10: ``counter [..., 4]``, ``key [..., 2]`` (int64 holding 32-bit words) -> ``[..., 4]``."""
    if counter.shape[-1] != 4 or key.shape[-1] != 2:
        raise ValueError(f"philox4x32: counter [..., 4] and key [..., 2] expected, got {counter.shape}, {key.shape}")
    c, k = _words(counter), _words(key)
    words = _philox([c[..., i] for i in range(4)], k[..., 0], k[..., 1])
    return torch.from_numpy(np.stack(words, axis=-1).astype(np.int64)).to(counter.device)


def request_key(request_id: int | str) -> int:
    """A request id as a 64-bit integer: ints as given (must fit), strings by a fixed hash (blake2b)."""
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        raise TypeError(f"request_id must be an int or str, got {type(request_id).__name__}")
    if isinstance(request_id, str):
        return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    if not 0 <= request_id < 1 << 64:
        raise ValueError(f"request_id={request_id} must be in [0, 2**64)")
    return request_id


def row_words(seeds: np.ndarray, request_keys: np.ndarray, samples: np.ndarray, positions: np.ndarray) -> list:
    """The four Philox words of each row's draw from uint64 arrays (what :func:`uniforms` and :func:`row_keys`
    compute from tensors): word 0 gives the row's uniform, words 0 and 1 its Gumbel key."""
    shift = np.uint64(32)
    return _philox([positions, samples, request_keys, request_keys >> shift], seeds, seeds >> shift)


def uniforms(
    seeds: torch.Tensor, request_keys: torch.Tensor, samples: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One fp32 uniform in [0, 1) per row, keyed by (seed, request id, sample index, position).

    All inputs are int64 tensors of one shape (seeds and request keys may use all 64 bits, stored
    as two's complement); the result has that shape, on the host.
    """
    word = row_words(_words(seeds), _words(request_keys), _words(samples), _words(positions))[0]
    return torch.from_numpy(word_uniform(word))


def word_uniform(word: np.ndarray) -> np.ndarray:
    """The fp32 uniform ``(word >> 8) * 2**-24`` of Philox words (exact in fp32)."""
    return (word >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)


def row_keys(
    seeds: torch.Tensor, request_keys: torch.Tensor, samples: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """A 64-bit Philox key per row, as ``[..., 2]`` int64 holding two 32-bit words: words 0 and 1 of the
    draw :func:`uniforms` takes word 0 of. The Gumbel sampler keys its per-token draws with it."""
    words = row_words(_words(seeds), _words(request_keys), _words(samples), _words(positions))
    return torch.from_numpy(np.stack(words[:2], axis=-1).astype(np.int64))


# Counter word 1 of the per-token draws: a stream of its own, apart from any other use of a row key.
GUMBEL_STREAM = 0x6D62


def _mulhilo32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for 32-bit words ``a`` (int64 tensor) and ``b``: split at 16
    bits so every partial product fits int64 exactly."""
    p_lo, p_hi = a * (b & 0xFFFF), a * (b >> 16)  # each < 2**48
    t = ((p_hi & 0xFFFF) << 16) + p_lo  # < 2**49
    return (p_hi >> 16) + (t >> 32), t & MASK32


def token_words(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Word 0 of Philox(counter = (token id, GUMBEL_STREAM, 0, 0), key = the row's key) for every row and token:
    ``keys [R, 2]`` from :func:`row_keys`, ``token_ids [V]`` global ids -> ``[R, V]`` int64 in [0, 2**32).
    Exact int64 torch arithmetic on the tensors' own device: the Triton kernel's words, bit for bit."""
    k0, k1 = keys[:, 0:1] & MASK32, keys[:, 1:2] & MASK32
    c0 = (token_ids.to(keys.device) & MASK32).expand(keys.shape[0], -1)
    c1 = torch.full_like(c0, GUMBEL_STREAM)
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + _W0) & MASK32, (k1 + _W1) & MASK32
        hi0, lo0 = _mulhilo32(c0, _M0)
        hi1, lo1 = _mulhilo32(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0
