"""SwiGLU / RoPE Triton kernels (GPU correctness profile) on a CUDA device, bit for bit.

Against the torch references on the CPU (the edge-case suite shared with the interpreter test) and on
CUDA (the same elementwise torch ops on the GPU), at random and edge values, 1 row vs many rows; the
dispatch and the plain backward; the registry probes against the CPU reference probes (the contract
lock's golden digests must not depend on which side computed them). NaNs compare as NaNs (payloads
differ between CPU and GPU); every other element compares as a bit pattern.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from tests.ops import ieee_math_triton_interpret_check as suite  # noqa: E402


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    suite.check("gpu", got, want)


def test_edge_suite_vs_cpu_reference():
    """Helpers (fp64 bits), SwiGLU, rope_cos_sin, apply_rope: every check of the interpreter suite, on CUDA."""
    suite.helper_checks("cuda")
    suite.iso_checks("cuda")
    suite.swiglu_checks("cuda")
    suite.rope_checks("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 4096])
def test_swiglu_vs_cuda_reference(dtype, rows):
    from megatron_iso.ops.activation import reference
    from megatron_iso.ops.activation.activation_triton import swiglu_triton

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, 2 * 3072, device="cuda", generator=g) * 6).to(dtype)
    gate, up = torch.chunk(x, 2, dim=-1)
    want = reference.swiglu(gate, up)
    got = swiglu_triton(gate, up)
    _same(got, want)
    _same(got, reference.swiglu(gate.cpu(), up.cpu()))
    # One row out of many gives the row's bits from a one-row call.
    _same(swiglu_triton(gate[rows // 2 : rows // 2 + 1], up[rows // 2 : rows // 2 + 1]), got[rows // 2 : rows // 2 + 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "rot"), [(1, 32, 128, 128), (777, 16, 256, 64), (64, 4, 128, 32)]
)
def test_rope_vs_cuda_reference(dtype, tokens, heads, head_dim, rot):
    from megatron_iso.ops.rope import reference
    from megatron_iso.ops.rope.rope_triton import apply_rope_triton, rope_cos_sin_triton

    g = torch.Generator(device="cuda").manual_seed(tokens)
    pos = torch.randint(0, 262144, (tokens,), device="cuda", generator=g)
    for theta in (10000.0, 1_000_000.0, 10_000_000.0):
        c, s = rope_cos_sin_triton(pos, rot, theta)
        rc, rs = reference.rope_cos_sin(pos, rot, theta)
        _same(c, rc)
        _same(s, rs)
    x = (torch.randn(tokens, heads, head_dim, device="cuda", generator=g) * 4).to(dtype)
    want = reference.apply_rope(x, rc, rs)
    got = apply_rope_triton(x, c, s)
    _same(got, want)
    _same(got, reference.apply_rope(x.cpu(), rc.cpu(), rs.cpu()))
    _same(apply_rope_triton(x[-1:], c[-1:], s[-1:]), got[-1:])


def test_dispatch_and_plain_backward():
    """CUDA + correctness runs the Triton kernels; the backward is the native formula's, as before."""
    from megatron_iso.ops import activation, rope
    from megatron_iso.ops.activation import native as act_native
    from megatron_iso.ops.common.dispatch import select
    from megatron_iso.ops.rope import native as rope_native

    cuda = torch.empty(1, device="cuda")
    assert select("swiglu", cuda, "correctness", activation.TRITON_MODULE).__name__ == "swiglu_triton"
    assert select("rope", cuda, "correctness", rope.TRITON_MODULE).__name__ == "apply_rope_triton"
    assert select("rope_cos_sin", cuda, "correctness", rope.TRITON_MODULE).__name__ == "rope_cos_sin_triton"

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(9, 2 * 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    y = activation.swiglu_packed(x)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    gate, up = torch.chunk(x, 2, dim=-1)
    (want,) = torch.autograd.grad(act_native.swiglu(gate, up), x, gy)
    _same(gx, want)

    pos = torch.arange(9, device="cuda")
    cos, sin = rope.rope_cos_sin(pos, 32)
    q = torch.randn(9, 4, 64, device="cuda", generator=g, requires_grad=True)
    out = rope.apply_rope(q, cos, sin)
    go = torch.randn_like(out)
    (gq,) = torch.autograd.grad(out, q, go)
    (want,) = torch.autograd.grad(rope_native.apply_rope(q, cos, sin), q, go)
    _same(gq, want)


def test_iso_exp_sigmoid_one_launch_and_chain_gradients():
    """ieee_math.iso_exp / iso_sigmoid of a CUDA tensor: one Triton launch, the chain's bits (forward, vs the
    same torch chain on CUDA) and the chain's gradient bits (with_plain_backward)."""
    from megatron_iso.bench.profiling import kernel_events, kernel_launches
    from megatron_iso.ops.common import ieee_math

    g = torch.Generator(device="cuda").manual_seed(6)
    x = (torch.randn(64, 151, device="cuda", generator=g) * 20).requires_grad_()
    for fn, chain in ((ieee_math.iso_exp, ieee_math._exp_chain), (ieee_math.iso_sigmoid, ieee_math._sigmoid_chain)):
        with torch.no_grad():
            fn(x.detach())  # compile outside the profile
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn(x.detach())
                torch.cuda.synchronize()
            launches = sum(row["calls"] for row in kernel_launches(kernel_events(prof)))
            _same(fn(x.detach()), chain(x.detach()))
        assert launches <= 2, launches  # the kernel (+ at most one contiguous copy), not ~30 chain ops
        y = fn(x)
        gy = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, gy)
        (want,) = torch.autograd.grad(chain(x), x, gy)
        _same(gx, want)


@pytest.mark.parametrize("op", ["swiglu", "rope", "rope_cos_sin"])
def test_probes_equal_cpu_reference_probes(op):
    """The lockfile's golden probe outputs: the CUDA Triton entry's equal the CPU reference entry's."""
    import importlib

    for module in ("megatron_iso.ops.activation.activation_triton", "megatron_iso.ops.rope.rope_triton"):
        importlib.import_module(module)  # registers the cuda entries
    from megatron_iso.registry import lookup

    gpu = lookup(op, "cuda", "correctness").probe()
    cpu = lookup(op, "cpu", "correctness").probe()
    assert sorted(gpu) == sorted(cpu)
    for k in cpu:
        _same(gpu[k], cpu[k])


def test_exp64_extremes_on_device():
    """Clamp boundaries and specials through the fp64 helper, against the reference on CUDA too."""
    from megatron_iso.ops.common import ieee_math
    from megatron_iso.ops.common.ieee_math_triton import eval64

    x = torch.tensor([-math.inf, -745.0, -708.0, -707.99, 0.0, -0.0, 709.0, 709.5, math.inf, math.nan],
                     dtype=torch.float64, device="cuda")  # fmt: skip
    for name, ref in (("exp64", ieee_math.exp64), ("sigmoid64", ieee_math.sigmoid64)):
        _same(eval64(name, x), ref(x))
        _same(eval64(name, x), ref(x.cpu()))
