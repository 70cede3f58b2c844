"""The parked form of the one-launch Triton attention under TRITON_INTERPRET=1 (skipped without triton).

A tile config with ``park=True`` keeps the running accumulator in an fp32 scratch tile per program between segment
merges instead of registers (``forward_kernels_triton._walk_parked``): the same merges of the same floats. Claimed
and checked here bit for bit (bit patterns): the parked training forward == the register form for every row of a
pack whose lengths straddle the 64-key blocks and 128-key segments (1 .. 300 keys: up to three segments, two
parks), GQA groups 1, 2 and 4, ungated and gated (per dim, per head), a head dim below its power-of-two tile width
(the parked tile's padded columns), and 16- and 32-row tiles; a parked decode step from a contiguous cache and from
a paged pool (shuffled 16-key blocks, NaN where nothing was written, real and placeholder host starts) == the
split decode == the training forward at each sequence's last position. The interpreter runs a program's ops in
order, so it shows the logic (what is parked, when, and read back where); the barrier that orders other threads'
stores before a read, and the bits of the compiled kernel, are the GPU test's (tests/gpu/test_attention_triton.py).
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import sys

    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.attention import attention_triton as at
    from megatron_iso.ops.attention import forward_launch_triton as launch
    from megatron_iso.ops.attention.kv_cache import KVStepPlan, PagedKVLayer
    from megatron_iso.testing.bits import bit_difference, same_bits

    GROUP, HKV, GATE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    LENS = [1, 63, 64, 65, 127, 128, 129, 300]  # both sides of the 64-key blocks and 128-key segments
    D, N = 24, len(LENS)  # head dim 24 in a 32-wide tile: the park holds padded columns too
    assert launch.SEG_BLOCKS * 64 == 128, "the lengths straddle 128-key segments"
    PARK16 = launch.AttentionTileConfig(16, 4, 1, park=True)
    PARK32 = launch.AttentionTileConfig(32, 4, 1, park=True)
    gen = torch.Generator().manual_seed(100 * GROUP + HKV)
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    T, HQ = cu[-1], GROUP * HKV
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (HQ, HKV, HKV))
    gate = {"none": None, "dim": torch.randn(T, HQ, D, generator=gen),
            "head": torch.randn(T, HQ, 1, generator=gen)}[GATE]
    train = at.attention_varlen(q, k, v, torch.tensor(cu), gate=gate, split=False)
    assert not torch.isnan(train).any()
    parked = at.attention_varlen(q, k, v, torch.tensor(cu), gate=gate, config=PARK16)
    assert same_bits(parked, train), bit_difference(parked, train)
    if GATE == "none":  # against the register form of the same 32-row tile: numpy's matmul (the interpreter's
        # dot) gives other bits at 32 rows than at 16, which the compiled kernel's per-element dots do not
        regs32 = at.attention_varlen(q, k, v, torch.tensor(cu), config=launch.AttentionTileConfig(32, 4, 1))
        parked = at.attention_varlen(q, k, v, torch.tensor(cu), config=PARK32)
        assert same_bits(parked, regs32), bit_difference(parked, regs32)
    last = [c - 1 for c in cu[1:]]
    want = train[last]

    def check(got, what):
        assert same_bits(got, want), (what, bit_difference(got, want))

    step = [t[last].contiguous() for t in (q, k, v)]
    gate_step = None if gate is None else gate[last].contiguous()
    starts = [n - 1 for n in LENS]
    slots = torch.randperm(N, generator=gen).tolist()
    cu_step = torch.arange(N + 1)

    kc = torch.full((N, 320, HKV, D), float("nan"))
    vc = kc.clone()
    for i, (a, n) in enumerate(zip(cu, LENS)):
        kc[slots[i], : n - 1] = k[a : a + n - 1]
        vc[slots[i], : n - 1] = v[a : a + n - 1]
    for cfg, split in ((PARK16, False), (None, True)):  # parked one launch, and the split decode it must equal
        got = at.attention_with_kv_cache(*step, kc.clone(), vc.clone(), torch.tensor(starts), cu_step,
                                         slots=torch.tensor(slots), gate=gate_step, config=cfg, split=split)
        check(got, ("contiguous cache", cfg, split))

    page = 16
    width = -(-512 // page)
    blocks = width * N + 2
    table = torch.randperm(blocks, generator=gen)[: width * N].view(N, width).contiguous()
    kp = torch.full((blocks, page, HKV, D), float("nan"))
    vp = kp.clone()
    write = []
    for i, (a, n) in enumerate(zip(cu, LENS)):
        j = torch.arange(n)
        rows = table[slots[i]][j // page] * page + j % page
        kp.view(-1, HKV, D)[rows[:-1]] = k[a : a + n - 1]
        vp.view(-1, HKV, D)[rows[:-1]] = v[a : a + n - 1]
        write.append(int(rows[-1]))
    layer = PagedKVLayer(kp, vp, table, torch.tensor(write))
    for placeholder in (False, True):
        plan = KVStepPlan(list(range(N + 1)), [0] * N if placeholder else starts, slots, device_positions=placeholder)
        got = at.attention_with_paged_kv_cache(*step, layer, torch.tensor(starts), cu_step, slots=torch.tensor(slots),
                                               gate=gate_step, plan=plan, config=PARK16, split=False)
        check(got, ("paged", placeholder))
    print("ok")
    """
)


@pytest.mark.parametrize(
    ("group", "hkv", "gate"),
    [(1, 2, "dim"), (2, 1, "none"), (4, 1, "head")],
    ids=["group1-gate-dim", "group2-ungated", "group4-gate-head"],
)
def test_parked_forward_equals_register_form_and_split_decode(group: int, hkv: int, gate: str) -> None:
    res = run_interpreted(SCRIPT, args=[str(group), str(hkv), gate], timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_park_field_and_contract_record() -> None:
    """``park`` must be a bool; the contract records a table's tile as [rows, warps, stages] and appends "park"
    only for a parked one, so the registered (unparked) tables keep their records and digests."""
    launch = pytest.importorskip("megatron_iso.ops.attention.forward_launch_triton")
    at = pytest.importorskip("megatron_iso.ops.attention.attention_triton")
    with pytest.raises(ValueError, match="park=1 must be a bool"):
        launch.AttentionTileConfig(64, 4, 3, park=1)
    assert not any(cfg.park for table in (launch.CONFIGS, launch.DECODE_CONFIGS) for cfg in table.values())
    assert at._tile_record(launch.AttentionTileConfig(64, 4, 3)) == [64, 4, 3]
    assert at._tile_record(launch.AttentionTileConfig(64, 4, 2, park=True)) == [64, 4, 2, "park"]
    consts = at._constants()
    assert consts["bfloat16_tile"] == [64, 4, 3] and consts["float32_decode_tile"] == [16, 4, 2]
