"""RoPE: cos/sin are a function of the absolute position only (bitwise), apply is batch invariant,
HF rotate_half layout, partial rotary, accuracy, and the native (HF fp32-angle) difference."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_iso.ops.rope import MAX_POSITION, apply_rope, inv_frequencies, rope_cos_sin, rotary_dim_for
from megatron_iso.ops.rope import reference as rope_ref
from megatron_iso.registry import lookup
from megatron_iso.testing.bits import same_bits

DTYPES = [torch.float32, torch.bfloat16]
MS = [1, 2, 3, 7, 8, 64]


def test_cos_sin_depend_on_position_only() -> None:
    """Decode (one position), prefill chunks and a training forward see the same cos/sin bits."""
    pos = torch.arange(0, 300)
    cos, sin = rope_cos_sin(pos, 32, 10000.0)
    for p in (0, 1, 63, 64, 65, 130, 299):
        c1, s1 = rope_cos_sin(torch.tensor([p]), 32, 10000.0)
        assert same_bits(c1[0], cos[p]) and same_bits(s1[0], sin[p])
    c2, s2 = rope_cos_sin(pos[37:101], 32, 10000.0)
    assert same_bits(c2, cos[37:101]) and same_bits(s2, sin[37:101])
    # a 2-D positions tensor (batch of sequences) too
    c3, _ = rope_cos_sin(torch.stack([pos[:5], pos[100:105]]), 32, 10000.0)
    assert same_bits(c3[1], cos[100:105])


@pytest.mark.parametrize("theta", [10000.0, 1_000_000.0])
def test_cos_sin_accuracy(theta: float) -> None:
    pos = torch.tensor([0, 1, 2, 100, 4095, 65535, 262143])
    cos, sin = rope_cos_sin(pos, 64, theta)
    for i, p in enumerate(pos.tolist()):
        for j in range(32):
            a = p * (1.0 / theta ** (2 * j / 64))
            # float32 rounding of the exact value: within half an ulp plus the fp64 angle error
            assert abs(cos[i, j].item() - math.cos(a)) <= 6.0e-8 + 1e-12 * p
            assert abs(sin[i, j].item() - math.sin(a)) <= 6.0e-8 + 1e-12 * p
            assert cos[i, j + 32].item() == cos[i, j].item()  # HF layout: cat(freqs, freqs)
    inv = inv_frequencies(8, theta)
    assert inv[0].item() == 1.0 and abs(inv[1].item() - theta ** (-2 / 8)) < 1e-16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_apply_batch_invariance(dtype: torch.dtype, fraction: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=g).to(dtype)
    rd = rotary_dim_for(32, fraction)
    pos = torch.randint(0, 5000, (64,), generator=g)
    cos, sin = rope_cos_sin(pos, rd, 10000.0)
    full = apply_rope(x, cos, sin)
    for m in MS:
        assert same_bits(apply_rope(x[:m], cos[:m], sin[:m]), full[:m]), f"M={m}"
        c, s = rope_cos_sin(pos[-m:], rd, 10000.0)
        assert same_bits(apply_rope(x[-m:], c, s), full[-m:]), f"last M={m}"
    perm = torch.randperm(64, generator=g)
    assert same_bits(apply_rope(x[perm], cos[perm], sin[perm]), full[perm])
    # partial rotary: channels past rotary_dim pass through untouched
    assert same_bits(full[..., rd:], x[..., rd:])


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_apply_matches_hf_rotate_half(fraction: float) -> None:
    """Against an independent float64 statement of HF Qwen3's rotate_half rotation."""
    g = torch.Generator().manual_seed(3)
    d = 64
    rd = rotary_dim_for(d, fraction)
    x = torch.randn(10, 2, d, generator=g)
    pos = torch.arange(10) * 37
    out = apply_rope(x, *rope_cos_sin(pos, rd, 10000.0)).double()
    half = rd // 2
    ang = pos.double()[:, None] * torch.tensor([10000.0 ** (-2 * j / rd) for j in range(half)], dtype=torch.float64)
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:rd].double()
    expect = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rd:].double()], dim=-1)
    assert (out - expect).abs().max().item() < 5e-6
    # and the stock HF-style path agrees within fp32 tolerance at small positions
    nat = apply_rope(x, *rope_cos_sin(pos, rd, 10000.0, profile="performance"), profile="performance").double()
    assert (nat - expect).abs().max().item() < 1e-4


def test_errors_and_registry() -> None:
    with pytest.raises(ValueError, match="even"):
        rotary_dim_for(32, 0.3)
    with pytest.raises(TypeError, match="integer"):
        rope_cos_sin(torch.tensor([1.0]), 8)
    with pytest.raises(ValueError, match="reduction range"):
        rope_cos_sin(torch.tensor([2**22]), 8, 10000.0)
    for op in ("rope", "rope_cos_sin"):
        impl = lookup(op, "cpu", "correctness")
        a, b = impl.probe(), impl.probe()
        assert all(same_bits(a[k], b[k]) for k in a)


def test_range_check_on_host_bound() -> None:
    """The limit is exact (inv_freq[0] = 1: the largest angle is the largest position); with a host
    bound the positions are never read (meta tensors: any read fails) and the bits are the same."""
    assert MAX_POSITION < rope_ref.MAX_ANGLE < MAX_POSITION + 1
    ok = torch.tensor([0, 5, MAX_POSITION])
    for p in ([MAX_POSITION + 1], [-MAX_POSITION - 1]):
        with pytest.raises(ValueError, match=f"position {abs(p[0])} beyond the exact reduction range"):
            rope_cos_sin(torch.tensor(p), 8)
    with pytest.raises(ValueError, match=f"<= {MAX_POSITION}"):
        rope_cos_sin(ok, 8, max_position=MAX_POSITION + 1)
    full, full_s = rope_cos_sin(ok, 64, 1e6)
    hinted, hinted_s = rope_cos_sin(ok, 64, 1e6, max_position=MAX_POSITION)
    assert same_bits(full, hinted) and same_bits(full_s, hinted_s)
    cos, _ = rope_cos_sin(torch.zeros(3, dtype=torch.int64, device="meta"), 8, max_position=7)
    assert cos.shape == (3, 8) and cos.device.type == "meta"
    with pytest.raises(RuntimeError, match="meta"):  # without the bound the check reads the meta tensor
        rope_cos_sin(torch.zeros(3, dtype=torch.int64, device="meta"), 8)
    # inv_freq: one device copy per (rotary_dim, theta, device), the reference's values.
    a = rope_ref.inv_frequencies_on(64, 1e6, torch.device("cpu"))
    assert a is rope_ref.inv_frequencies_on(64, 1e6, torch.device("cpu"))
    assert torch.equal(a.view(torch.int64), inv_frequencies(64, 1e6).view(torch.int64))


def test_pack_checks_positions_on_host() -> None:
    """pack knows the positions as host ints: it checks the range (naming the sequence) and records
    the bound the forward's RoPE uses instead of reading the positions back."""
    from megatron_iso.models.batch import pack
    from megatron_iso.ops.attention.kv_cache import KVCache

    _, batch = pack([[1, 2, 3], [4]])
    assert batch.max_position == int(batch.positions.abs().max()) == 2
    for case, starts in (("prefill", [10, MAX_POSITION - 2]), ("decode", [MAX_POSITION, 7])):
        seqs = [[1, 2], [3, 4, 5]] if case == "prefill" else [[1], [2]]
        kv = KVCache.allocate(1, 2, 4, 1, 2)
        _, batch = pack(seqs, start_positions=starts, case=case, kv_cache=kv, slots=[0, 1])
        assert batch.max_position == int(batch.positions.abs().max()) == MAX_POSITION
        bad = [starts[0], starts[1] + 1] if case == "prefill" else [starts[0] + 1, starts[1]]
        i = 1 if case == "prefill" else 0
        with pytest.raises(ValueError, match=rf"sequence {i} \(start_positions\[{i}\]={bad[i]}.*<= {MAX_POSITION}"):
            pack(seqs, start_positions=bad, case=case, kv_cache=kv, slots=[0, 1])


def test_native_differences_measured() -> None:
    """HF computes angles in fp32: the error grows with position (the reference forms them in fp64)."""
    pos = torch.tensor([10, 1000, 8191, 32767, 131071])
    ref_c, _ = rope_cos_sin(pos, 128, 1_000_000.0)
    nat_c, _ = rope_cos_sin(pos, 128, 1_000_000.0, profile="performance")
    diff = (ref_c - nat_c).abs().max(-1).values
    print("rope cos |native - reference| by position", dict(zip(pos.tolist(), diff.tolist(), strict=True)))
    assert diff[-1].item() > 1e-4  # certain: fp32 angle spacing at 131071 rad is ~0.0078
    # native apply rounds in bf16 after each op; the reference rounds once
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 2, 64, generator=g).bfloat16()
    c, s = rope_cos_sin(torch.arange(64), 64, 10000.0)
    d = apply_rope(x, c, s).float() - apply_rope(x, c, s, profile="performance").float()
    print(
        f"rope apply bf16: native differs in {(d != 0).float().mean().item():.2%} of elements, max {d.abs().max().item():.3g}"
    )
