"""Run under TRITON_INTERPRET=1 by test_ieee_math_triton_interpret.py (and by tests/gpu on a device).

The SwiGLU / RoPE Triton kernels and the float64 helpers they are built from against the torch
references, bit for bit, over random values and edge cases. Under the interpreter numpy does the
float64 math (IEEE, no FMA), so equality here checks that the kernels perform the reference's
operation sequence; on a GPU the same checks add the compiler (FMA contraction off) and hardware.

``python tests/ops/ieee_math_triton_interpret_check.py [device]`` prints ``ok`` or fails an assert.
"""

from __future__ import annotations

import math
import sys

import torch

from megatron_iso.ops.activation import reference as act_ref
from megatron_iso.ops.activation.activation_triton import swiglu_triton
from megatron_iso.ops.common import ieee_math
from megatron_iso.ops.common.ieee_math_triton import eval64, iso_eval
from megatron_iso.ops.rope import reference as rope_ref
from megatron_iso.ops.rope.rope_triton import apply_rope_triton, rope_cos_sin_triton

INT = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bit patterns differ; two NaNs count as equal (payloads differ between CPU and GPU)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    a, b = a.cpu(), b.cpu()
    t = INT[a.element_size()]
    diff = (a.view(t) != b.view(t)) & ~(a.isnan() & b.isnan())
    return int(diff.sum())


def check(name: str, got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor | None = None) -> None:
    n = mismatches(got, want)
    if n:
        t = INT[got.element_size()]
        bad = ((got.cpu().view(t) != want.cpu().view(t)) & ~(got.cpu().isnan() & want.cpu().isnan())).nonzero()[:5]
        where = [tuple(i.tolist()) for i in bad]
        detail = [(inputs.cpu()[w].item() if inputs is not None else None, got.cpu()[w].item(), want.cpu()[w].item())
                  for w in where]  # fmt: skip
        raise AssertionError(f"{name}: {n} of {got.numel()} differ; first (input, got, want): {detail}")


def edge_values64() -> torch.Tensor:
    """float64 arguments around every boundary the helpers have."""
    ln2 = math.log(2.0)
    vals = [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 1e-310, -1e-310, 1e-300, 2.2e-308]
    for b in (708.0, 709.0, 710.0, 745.0, 1000.0, 1e300, 88.0, 89.0, 103.0, 104.0, 150.0, 1.0, 0.5, 1e-8):
        for v in (b, math.nextafter(b, math.inf), math.nextafter(b, 0.0)):
            vals += [v, -v]
    # Ties of round(x / ln2): x near (n + 1/2) ln2, and near n ln2.
    for n in range(-12, 13):
        for c in ((n + 0.5) * ln2, n * ln2):
            vals += [c, math.nextafter(c, math.inf), math.nextafter(c, -math.inf)]
    # Quadrant ties of round(angle * 2/pi) and angles up to the reduction range.
    for n in (-3, -2, -1, 0, 1, 2, 3, 4, 5, 1001, 2**19 + 7):
        for c in ((n + 0.5) * math.pi / 2, n * math.pi / 2):
            vals += [c, math.nextafter(c, math.inf), math.nextafter(c, -math.inf)]
    return torch.tensor(vals, dtype=torch.float64)


def helper_checks(device: str) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.cat([edge_values64(), torch.randn(3000, generator=g, dtype=torch.float64) * 40,
                   torch.randn(1000, generator=g, dtype=torch.float64) * 1e-3])  # fmt: skip
    xd = x.to(device)
    check("exp64", eval64("exp64", xd), ieee_math.exp64(x), x)
    check("sigmoid64", eval64("sigmoid64", xd), ieee_math.sigmoid64(x), x)
    check("silu64", eval64("silu64", xd), x * ieee_math.sigmoid64(x), x)
    # sincos: finite angles within the reduction range (the reference raises beyond it).
    a = x[torch.isfinite(x) & (x.abs() <= rope_ref.MAX_ANGLE)]
    a = torch.cat([a, torch.rand(2000, generator=g, dtype=torch.float64) * rope_ref.MAX_ANGLE])
    s, c = ieee_math.sincos64(a)
    check("sin64", eval64("sin64", a.to(device)), s, a)
    check("cos64", eval64("cos64", a.to(device)), c, a)
    # log64: positive normal inputs, the whole exponent range and both sides of the sqrt(2) mantissa split.
    pos = x.abs()[(x.abs() > 2.3e-308) & torch.isfinite(x)]
    split = torch.tensor([math.sqrt(2.0), math.nextafter(math.sqrt(2.0), 0.0), math.nextafter(math.sqrt(2.0), 3.0)],
                         dtype=torch.float64)  # fmt: skip
    lg = torch.cat([pos, split, torch.rand(2000, generator=g, dtype=torch.float64) + 2.0**-60,
                    torch.exp(torch.rand(1000, generator=g, dtype=torch.float64) * 1400 - 700)])  # fmt: skip
    check("log64", eval64("log64", lg.to(device)), ieee_math.log64(lg), lg)


def iso_checks(device: str) -> None:
    """The one-launch iso_exp / iso_sigmoid (float32 results from 16/32-bit inputs) against the torch chain,
    and, on a GPU, that ``ieee_math.iso_exp`` / ``iso_sigmoid`` of a device tensor returns the same bits."""
    g = torch.Generator().manual_seed(14)
    gate, _ = swiglu_inputs(torch.float32)  # fp32 edges: +-0, inf, nan, subnormals, exp over/underflow
    x = torch.cat([gate, torch.randn(3000, generator=g) * 40, torch.randn(500, generator=g) * 1e-3])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = x.to(dtype)
        want_exp, want_sig = ieee_math._exp_chain(xs), ieee_math._sigmoid_chain(xs)
        check(f"iso_eval exp {dtype}", iso_eval("exp", xs.to(device)), want_exp, xs)
        check(f"iso_eval sigmoid {dtype}", iso_eval("sigmoid", xs.reshape(2, -1).to(device)), want_sig.reshape(2, -1))
        if device != "cpu":
            check(f"ieee_math.iso_exp {dtype} on {device}", ieee_math.iso_exp(xs.to(device)), want_exp, xs)
            check(f"ieee_math.iso_sigmoid {dtype} on {device}", ieee_math.iso_sigmoid(xs.to(device)), want_sig, xs)


def swiglu_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 1e-38, -1e-38, 3.0e38, -3.0e38, 1e-3, -1e-3]
    edges += [
        s * v for v in (88.0, 89.0, 100.0, 103.0, 104.0, 150.0, 708.0, 709.0, 710.0, 745.0, 1000.0) for s in (1, -1)
    ]
    gate_edges = torch.tensor(edges)
    up_edges = torch.tensor([1.0, -1.0, 0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 3.0e38, 0.5])
    # Every gate edge against every up edge, plus random values over the range where silu bends.
    ge, ue = torch.meshgrid(gate_edges, up_edges, indexing="ij")
    gr = torch.randn(4096, generator=g) * 12
    ur = torch.randn(4096, generator=g) * 3
    # Near-subnormal outputs: silu(g) ~ g e^g underflows fp32 for g < ~-95.
    gs = -torch.rand(512, generator=g) * 20 - 90
    us = torch.rand(512, generator=g)
    gate = torch.cat([ge.reshape(-1), gr, gs]).to(dtype)
    up = torch.cat([ue.reshape(-1), ur, us]).to(dtype)
    return gate, up


def swiglu_checks(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gate, up = swiglu_inputs(dtype)
        want = act_ref.swiglu(gate, up)
        gd, ud = gate.to(device), up.to(device)
        check(f"swiglu {dtype} 1-d", swiglu_triton(gd, ud), want, gate)
        # Shapes: 1 row, many rows, 3-d, and the packed [gate | up] layout read through chunk views.
        n = gate.numel() // 8 * 8
        g2, u2 = gate[:n].reshape(8, -1), up[:n].reshape(8, -1)
        w2 = act_ref.swiglu(g2, u2)
        check(f"swiglu {dtype} rows", swiglu_triton(g2.to(device), u2.to(device)), w2)
        check(f"swiglu {dtype} 1 row", swiglu_triton(g2[3:4].to(device), u2[3:4].to(device)), w2[3:4])
        packed = torch.cat([g2, u2], dim=-1).reshape(2, 4, -1).to(device)
        gv, uv = torch.chunk(packed, 2, dim=-1)
        check(f"swiglu {dtype} packed views", swiglu_triton(gv, uv), w2.reshape(2, 4, -1))
        # A non-unit inner stride is copied first; bits do not change.
        check(f"swiglu {dtype} transposed", swiglu_triton(gv.transpose(0, 1), uv.transpose(0, 1)),
              w2.reshape(2, 4, -1).transpose(0, 1).contiguous())  # fmt: skip


def rope_checks(device: str) -> None:
    g = torch.Generator().manual_seed(13)
    pos = torch.cat([torch.tensor([0, 1, 2, 3, 63, 64, 65, 1000, 4095, 32767, 131071, 1000003, 1647099, -1, -77]),
                     torch.randint(0, 300000, (200,), generator=g)])  # fmt: skip
    for rot, theta in ((2, 10000.0), (8, 10000.0), (64, 1_000_000.0), (128, 5_000_000.0), (96, 10000.0)):
        rc, rs = rope_ref.rope_cos_sin(pos, rot, theta)
        c, s = rope_cos_sin_triton(pos.to(device), rot, theta)
        check(f"cos rot={rot}", c, rc)
        check(f"sin rot={rot}", s, rs)
        c2, s2 = rope_cos_sin_triton(pos.reshape(5, -1).to(device), rot, theta)
        check(f"cos 2-d rot={rot}", c2, rc.reshape(5, -1, rot))
        check(f"sin 2-d rot={rot}", s2, rs.reshape(5, -1, rot))
    try:
        rope_cos_sin_triton(torch.tensor([2**21]).to(device), 8)
    except ValueError as exc:
        assert "reduction range" in str(exc), exc
    else:
        raise AssertionError("rope_cos_sin_triton accepted an angle beyond the exact reduction range")

    T = 23
    p = torch.randint(0, 200000, (T,), generator=g)
    x = torch.randn(T, 5, 128, generator=g) * 3
    # Edge entries in x: zeros of both signs, inf, nan, fp32 subnormals, huge values whose products overflow.
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:400]
    edge = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 1e-40, 3.0e38, -3.0e38])
    flat[idx] = edge[torch.arange(400) % edge.numel()]
    for rot, head_dim in ((128, 128), (32, 128), (64, 80), (2, 6)):
        rc, rs = rope_ref.rope_cos_sin(p, rot, 10000.0)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xs = x[..., :head_dim].to(dtype)
            want = rope_ref.apply_rope(xs, rc, rs)
            cd, sd = rc.to(device), rs.to(device)
            check(f"apply_rope {dtype} rot={rot} D={head_dim}", apply_rope_triton(xs.to(device), cd, sd), want)
            check(f"apply_rope {dtype} 1 token", apply_rope_triton(xs[7:8].to(device), cd[7:8], sd[7:8]), want[7:8])
            # A strided view, as q/k come out of the fused QKV projection.
            big = torch.stack([xs, xs], dim=2).reshape(T, -1, head_dim).to(device)[:, ::2]
            assert big.stride(1) == 2 * head_dim
            check(f"apply_rope {dtype} strided", apply_rope_triton(big, cd, sd), want)


def main(device: str = "cpu") -> None:
    helper_checks(device)
    iso_checks(device)
    swiglu_checks(device)
    rope_checks(device)
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
