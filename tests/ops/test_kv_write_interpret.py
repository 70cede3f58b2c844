"""The KV cache write of the Triton attention (``attention_triton.write_cache``) under TRITON_INTERPRET=1: k and v
as the model passes them (views of the fused QKV projection, rows a projection row apart) land in the cache rows
``dst`` names, bit for bit what two ``index_copy_`` calls leave, and no other row changes."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_iso.ops.attention.attention_triton import write_cache

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        qkv = torch.randn(5, 6 + 2 + 2, 24, generator=g).to(dtype)  # [T, q heads | k heads | v heads, D]
        k, v = qkv[:, 6:8], qkv[:, 8:10]
        assert not k.is_contiguous()
        kc, vc = torch.randn(2, 9, 2, 24, generator=g).to(dtype), torch.randn(2, 9, 2, 24, generator=g).to(dtype)
        want_k, want_v = kc.clone(), vc.clone()
        dst = torch.tensor([3, 4, 5, 12, 13])  # sequence 0 at positions 3..5 of row 0, sequence 1 at 3..4 of row 1
        write_cache(k, v, kc, vc, [0, 3, 5], [3, 3], [0, 1], dst=dst)
        want_k.view(-1, 2, 24).index_copy_(0, dst, k)
        want_v.view(-1, 2, 24).index_copy_(0, dst, v)
        b = (lambda t: t.view(torch.int16)) if dtype == torch.bfloat16 else (lambda t: t.view(torch.int32))
        assert torch.equal(b(kc), b(want_k)) and torch.equal(b(vc), b(want_v)), dtype
    print("ok")
    """
)


def test_kv_write_copies_strided_rows_exactly():
    res = run_interpreted(SCRIPT, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
