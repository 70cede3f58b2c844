"""The Triton attention backward on CPU under TRITON_INTERPRET=1 (tiny shapes; skipped without triton):
its gradients against fp64 autograd of per-sequence softmax attention (GQA, a 1-token and an empty
sequence, no gate / a per-dim gate / a per-head gate), and the same bits on a second call."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import itertools, math
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.attention import backward_triton as bt

    bits = lambda t: t.view(torch.int32)
    g = torch.Generator().manual_seed(5)
    hq, hkv, d = 4, 2, 16
    cu = [0, 1, 6, 6, 20, 37]
    q, k, v = (torch.randn(37, h, d, generator=g) for h in (hq, hkv, hkv))
    scale = 1 / math.sqrt(d)

    def reference(q, k, v, gate):
        outs = []
        for a, b in itertools.pairwise(cu):
            qs = q[a:b].transpose(0, 1)
            ks = k[a:b].repeat_interleave(2, 1).transpose(0, 1)
            vs = v[a:b].repeat_interleave(2, 1).transpose(0, 1)
            s = (qs @ ks.transpose(1, 2)) * scale
            s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
            outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        out = torch.cat(outs)
        return out if gate is None else out * torch.sigmoid(gate)

    for gate_shape in (None, (37, hq, d), (37, hq, 1)):
        gate = None if gate_shape is None else torch.randn(*gate_shape, generator=g)
        upstream = torch.randn(37, hq, d, generator=g)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        gate64 = None if gate is None else gate.double().requires_grad_()
        reference(*leaves, gate64).backward(upstream.double())
        want = [t.grad for t in leaves] + ([None] if gate is None else [gate64.grad])
        cu_t = torch.tensor(cu)
        got = bt.attention_backward(q, k, v, upstream, cu_t, 17, scale, gate)
        again = bt.attention_backward(q, k, v, upstream, cu_t, 17, scale, gate)
        for name, x, y, z in zip(("dq", "dk", "dv", "dgate"), got, again, want):
            if z is None:
                assert x is None and y is None, name
                continue
            assert x.dtype == torch.float32 and x.shape == z.shape, (name, x.dtype, x.shape)
            assert torch.equal(bits(x), bits(y)), f"{name}: a second call gave other bits"
            rel = float((x.double() - z).norm() / z.norm())
            assert rel < 1e-5, (gate_shape, name, rel)
    print("ok")
    """
)


def test_attention_backward_under_interpreter():
    res = run_interpreted(SCRIPT, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
