"""The Triton attention kernel on CPU under TRITON_INTERPRET=1 (tiny shapes; skipped without triton).

What the interpreter can show: the kernel's logic (masking, GQA rows, online softmax, key segments, gate,
cache write, chunk offsets) against an fp64 reference, prefill-from-0 == varlen bit for bit (the same rows
land at the same tile positions), and decode == varlen bit for bit: the interpreter's dot is numpy's matmul,
which with this numpy/BLAS gives a row the same bits wherever it sits in the tile (asserted, so a BLAS whose
per-row bits depend on the row's position fails here first; tests/ops/test_attention_split_interpret.py relies
on it). The GPU test (tests/gpu/test_attention_triton.py) proves the claims on the compiled kernel. triton 3.6's
interpreter cannot loop to a run-time bound with numpy 2.x (``int()`` of a 1-element array); the subprocess
patches that one conversion.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import math
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.attention import attention_triton as at

    b = lambda t: t.view(torch.int32)
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 16
    q, k, v, g = (torch.randn(40, h, d) for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0, 3, 40])
    o = at.attention_varlen(q, k, v, cu, gate=g, kv_block=16)
    ref = torch.empty(40, hq, d, dtype=torch.float64)
    for a, e in ((0, 3), (3, 40)):
        for t in range(a, e):
            for h in range(hq):
                s = k[a : t + 1, h // 2].double() @ q[t, h].double() / math.sqrt(d)
                ref[t, h] = torch.softmax(s, 0) @ v[a : t + 1, h // 2].double()
    ref = ref * torch.sigmoid(g.double())
    rel = float((o.double() - ref).norm() / ref.norm())
    assert rel < 1e-6, rel
    kc = torch.full((2, 48, hkv, d), float("nan"))
    vc = kc.clone()
    pre = at.attention_with_kv_cache(q, k, v, kc, vc, torch.tensor([0, 0]), cu, slots=torch.tensor([1, 0]), gate=g,
                                     kv_block=16)
    assert torch.equal(b(pre), b(o)), "prefill from 0 != varlen"
    assert torch.equal(b(kc[0, :37]), b(k[3:])) and torch.equal(b(vc[1, :3]), b(v[:3]))
    kc2 = torch.full((1, 48, hkv, d), float("nan"))
    vc2 = kc2.clone()
    outs = [at.attention_with_kv_cache(q[3:23], k[3:23], v[3:23], kc2, vc2, torch.tensor([0]), torch.tensor([0, 20]),
                                       gate=g[3:23], kv_block=16)]
    for t in range(23, 40):
        s = slice(t, t + 1)
        outs.append(at.attention_with_kv_cache(q[s], k[s], v[s], kc2, vc2, torch.tensor([t - 3]),
                                               torch.tensor([0, 1]), gate=g[s], kv_block=16))
    dec = torch.cat(outs)
    assert float((dec - o[3:]).abs().max()) < 1e-6
    assert torch.equal(b(dec[:20]), b(o[3:23])), "chunk aligned like varlen must match bitwise"
    assert torch.equal(b(dec), b(o[3:])), "decode != varlen in the interpreter (numpy's matmul by row position?)"
    print("ok")
    """
)


def test_attention_kernel_under_interpreter():
    res = run_interpreted(SCRIPT, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


PLAN_SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.attention import attention_triton as at
    from megatron_iso.ops.attention import forward_launch_triton as launch
    from megatron_iso.ops.attention.kv_cache import KVStepPlan

    cpu = torch.device("cpu")
    # A pure-decode tile table depends on (batch, group, block_m) only: built once, the values of
    # the per-step construction (group > block_m too: two tiles per sequence, later rows first).
    for n, group, block_m in ((1, 2, 16), (5, 2, 16), (64, 8, 16), (3, 8, 4), (7, 5, 2)):
        first = launch._plan([1] * n, group, block_m, cpu)
        assert launch._plan([1] * n, group, block_m, cpu) is first, "decode table rebuilt"
        fresh = launch._build_plan([1] * n, group, block_m, cpu)
        assert all(torch.equal(a, b) for a, b in zip(first, fresh)), (n, group, block_m)
    seq, row = launch._plan([1] * 3, 8, 4, cpu)
    assert seq.tolist() == [0, 1, 2, 0, 1, 2] and row.tolist() == [4, 4, 4, 0, 0, 0], (seq, row)
    mixed = [1, 3, 1]
    assert launch._plan(mixed, 2, 16, cpu) is not launch._plan(mixed, 2, 16, cpu), "only pure-decode tables are shared"
    # A decode step of 3 sequences: the same bits with the shared table as with one built for the call.
    torch.manual_seed(1)
    hq, hkv, d = 4, 2, 16
    q, k, v = (torch.randn(3, h, d) for h in (hq, hkv, hkv))
    starts = [5, 17, 0]
    kc = torch.randn(3, 32, hkv, d)
    vc = torch.randn(3, 32, hkv, d)
    outs = []
    for _ in range(2):
        launch._decode_plan.cache_clear()
        for _ in range(2):  # cold (builds the table), then warm (reuses it)
            plan = KVStepPlan([0, 1, 2, 3], starts, [2, 0, 1])
            kk, vv = kc.clone(), vc.clone()
            outs.append(at.attention_with_kv_cache(q, k, v, kk, vv, torch.tensor(starts), torch.tensor([0, 1, 2, 3]),
                                                   slots=torch.tensor([2, 0, 1]), kv_block=16, plan=plan))
    assert launch._decode_plan.cache_info().hits >= 1
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs)
    print("ok")
    """
)


def test_decode_tile_table_is_built_once():
    res = run_interpreted(PLAN_SCRIPT, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
