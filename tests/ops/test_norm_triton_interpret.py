"""Triton kernels on CPU under TRITON_INTERPRET=1 (tiny shapes; skipped without triton).

Only the loop-free RMSNorm kernel runs here: triton 3.6's interpreter fails on run-time loop bounds
with numpy 2.x (``int()`` of a 1-element array), which the GEMM and logprob kernels use. Those are
checked bit for bit on a GPU by tests/gpu.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_iso.ops.norm.norm_triton import gated_rms_norm_triton, rms_norm_triton

    b = lambda t: t.view(torch.int32)
    torch.manual_seed(0)
    x = torch.randn(4, 48)
    w = torch.randn(48)
    y = rms_norm_triton(x, w)
    assert torch.equal(b(rms_norm_triton(x[:1], w)[0]), b(y[0]))
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-6
    z = torch.randn(4, 48)
    g = gated_rms_norm_triton(x, z, w, zero_centered=True)
    assert torch.equal(b(gated_rms_norm_triton(x[2:3], z[2:3], w, zero_centered=True)[0]), b(g[2]))
    # the gate read in place: [T, H, D] heads of a column slice of a wider row (the GDN layer's z)
    wide = torch.randn(4, 3 * 16 + 11)
    zh = wide[:, 7 : 7 + 48].reshape(4, 3, 16)
    xh, wh = torch.randn(4, 3, 16), torch.randn(16)
    assert zh.stride() == (59, 16, 1)
    assert torch.equal(b(gated_rms_norm_triton(xh, zh, wh)), b(gated_rms_norm_triton(xh, zh.contiguous(), wh)))
    print("ok")
    """
)


def test_triton_kernels_under_interpreter():
    res = run_interpreted(SCRIPT, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
