"""Bit-pattern views for bitwise claims: ``torch.equal`` on these is equality of every bit (so -0.0 != +0.0, and
two NaNs are equal only with the same payload), which ``allclose`` or ``==`` on floats is not."""

from __future__ import annotations

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor | float) -> torch.Tensor:
    """``x``'s bits as integers of the same width (a Python float as fp64; a complex tensor as its real and imaginary
    parts, ``[..., 2]``); integer and bool tensors as they are."""
    t = torch.tensor(x, dtype=torch.float64) if isinstance(x, float) else x
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return t
    return t.view(_INT_OF_WIDTH[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, same dtype, same bits."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def bit_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where ``a`` and ``b`` differ in bits, for a failing bitwise assertion's message: how many rows (indices along
    dim 0) hold a differing bit, the first of them, and the largest absolute difference. A token-major output's
    first differing row is the first token whose bits moved, which a max |d| alone does not tell."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype differ: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    b = b.to(a.device)
    differ = bits(a) != bits(b)
    if not bool(differ.any()):
        return "same bits"
    rows = differ.reshape(differ.shape[0], -1).any(1).nonzero().flatten().tolist() if a.dim() else [0]
    ra, rb = (torch.view_as_real(t) if t.is_complex() else t for t in (a, b))
    gap = float((ra.double() - rb.double()).abs().max()) if ra.is_floating_point() else float("nan")
    return f"{len(rows)} of {a.shape[0] if a.dim() else 1} rows differ, first {rows[:4]}, max |d| {gap:.3e}"
