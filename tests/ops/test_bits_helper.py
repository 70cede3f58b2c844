"""megatron_iso.testing.bits: the bit-pattern views every bitwise test compares."""

from __future__ import annotations

import torch

from megatron_iso.testing.bits import bit_difference, bits, same_bits


def test_signed_zeros_and_nan_payloads_differ_where_float_equality_does_not_tell() -> None:
    z = torch.tensor([0.0, -0.0])
    assert bool(z[0] == z[1]) and not torch.equal(bits(z[0]), bits(z[1]))
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not same_bits(nan_a, nan_b) and same_bits(nan_a, nan_a.clone())


def test_widths_dtypes_and_shapes() -> None:
    for dtype, idt in ((torch.float64, torch.int64), (torch.float32, torch.int32), (torch.bfloat16, torch.int16),
                       (torch.float16, torch.int16)):  # fmt: skip
        x = torch.linspace(-2, 2, 6).to(dtype)
        assert bits(x).dtype == idt and bits(x[::2]).shape == (3,)
    assert bits(1.5).dtype == torch.int64 and int(bits(1.5)) == 0x3FF8000000000000
    ids = torch.tensor([3, 1])
    assert bits(ids) is ids
    a = torch.ones(2, 3)
    assert not same_bits(a, a.double()) and not same_bits(a, a.reshape(3, 2)) and same_bits(a, a.clone())


def test_complex_tensors_compare_by_the_bits_of_both_parts() -> None:
    for dtype in (torch.complex64, torch.complex128):
        z = torch.tensor([1 + 0j, 2 - 1j], dtype=dtype)
        w = z.clone()
        w.imag[0] = -0.0  # equal as numbers, not as bits
        assert bool((z == w).all()) and not same_bits(z, w) and same_bits(z, z.clone())
        assert bits(z).shape == (2, 2)


def test_bit_difference_names_the_first_differing_rows() -> None:
    a = torch.zeros(6, 3)
    b = a.clone()
    assert bit_difference(a, b) == "same bits"
    b[4, 1] = -0.0  # equal as numbers: only the bits tell
    b[2, 0] = 1e-8
    msg = bit_difference(a, b)
    assert msg.startswith("2 of 6 rows differ, first [2, 4]") and "1.000e-08" in msg
    assert bit_difference(a, a.double()).startswith("shape/dtype differ")
    assert bit_difference(torch.tensor(1.0), torch.tensor(-1.0)).startswith("1 of 1 rows differ, first [0]")
