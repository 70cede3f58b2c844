"""The Triton attention backward on the GPU: the same bits on every call, gradients within bf16
rounding of fp64 autograd, and the training path (ops.attention.attention_varlen) routed through it
with the forward's bits unchanged."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_iso.testing.bits import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


def _inputs(lens, hq, hkv, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, device="cuda", generator=g).bfloat16() for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *itertools.accumulate(lens)], device="cuda")
    return q, k, v, cu


def _reference(q, k, v, cu, scale, gate):
    group = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu.tolist()):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].repeat_interleave(group, 1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(group, 1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    out = torch.cat(outs)
    return out if gate is None else out * torch.sigmoid(gate)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("lens", "hq", "hkv", "d"), [([768, 1, 300, 0, 129], 32, 8, 128), ([64, 200], 16, 2, 256)])
def test_backward_deterministic_and_close_to_fp64(lens, hq, hkv, d, gated):
    from megatron_iso.ops.attention.backward_triton import attention_backward

    q, k, v, cu = _inputs(lens, hq, hkv, d)
    scale = 1 / math.sqrt(d)
    gate = torch.randn(q.shape[0], hq, d, device="cuda").bfloat16() if gated else None
    upstream = torch.randn(q.shape, device="cuda").bfloat16()
    got = attention_backward(q, k, v, upstream, cu, max(lens), scale, gate)
    again = attention_backward(q, k, v, upstream, cu, max(lens), scale, gate)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    gate64 = None if gate is None else gate.double().requires_grad_()
    _reference(*leaves, cu, scale, gate64).backward(upstream.double())
    want = [t.grad for t in leaves] + [None if gate64 is None else gate64.grad]
    for name, x, y, z in zip(("dq", "dk", "dv", "dgate"), got, again, want, strict=True):
        if z is None:
            assert x is None
            continue
        assert same_bits(x, y), f"{name}: not deterministic"
        assert x.dtype == torch.bfloat16
        rel = float((x.double() - z).norm() / z.norm())
        assert rel < 2**-6, f"{name}: relative error {rel:.3e}"


def test_training_attention_uses_the_kernel_and_keeps_forward_bits():
    from megatron_iso.ops.attention import attention_varlen

    q, k, v, cu = _inputs([500, 37], 8, 2, 128, seed=1)
    with torch.no_grad():
        plain_forward = attention_varlen(q, k, v, cu)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention_varlen(qr, kr, vr, cu)
    assert same_bits(out, plain_forward)
    assert type(out.grad_fn).__name__ == "_KernelBackwardBackward"
    out.float().square().sum().backward()
    assert all(t.grad is not None and bool(torch.isfinite(t.grad.float()).all()) for t in (qr, kr, vr))
