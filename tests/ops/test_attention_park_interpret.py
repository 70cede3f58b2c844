"""The parked form of the one-launch Triton attention under TRITON_INTERPRET=1 (skipped without triton).

A tile config with ``park=True`` keeps the running accumulator in an fp32 scratch tile per program between segment
merges instead of registers (``forward_kernels_triton._walk``, ``PARK``): the same merges of the same floats. Claimed
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
import torch

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
    from megatron_iso.testing.attention_cases import DecodeCase
    from megatron_iso.testing.bits import bit_difference, same_bits

    GROUP, HKV, GATE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # head dim 24 in a 32-wide tile: the park holds padded columns too
    case = DecodeCase(GROUP, HKV, GATE, d=24, seed=100 * GROUP + HKV)
    PARK16 = launch.AttentionTileConfig(16, 4, 1, park=True)
    PARK32 = launch.AttentionTileConfig(32, 4, 1, park=True)
    cu = torch.tensor(case.cu)
    parked = at.attention_varlen(case.q, case.k, case.v, cu, gate=case.gate, config=PARK16)
    assert same_bits(parked, case.train), bit_difference(parked, case.train)
    if GATE == "none":  # against the register form of the same 32-row tile: numpy's matmul (the interpreter's
        # dot) gives other bits at 32 rows than at 16, which the compiled kernel's per-element dots do not
        regs32 = at.attention_varlen(case.q, case.k, case.v, cu, config=launch.AttentionTileConfig(32, 4, 1))
        parked = at.attention_varlen(case.q, case.k, case.v, cu, config=PARK32)
        assert same_bits(parked, regs32), bit_difference(parked, regs32)

    for cfg, split in ((PARK16, False), (None, True)):  # parked one launch, and the split decode it must equal
        case.check(case.contiguous(cfg, split), ("contiguous cache", cfg, split))
    layer = case.paged_layer(16)
    for placeholder in (False, True):
        case.check(case.paged(layer, placeholder, PARK16, split=False), ("paged", placeholder))
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
    """``park`` must be a bool and ``maxnreg`` None or a register count; the contract records a table's tile as
    [rows, warps, stages] and appends "park" only for a parked one (the bf16/fp16 training tile) and "maxnreg=N"
    only for a capped one (fp32), so the other tables keep their records and digests."""
    launch = pytest.importorskip("megatron_iso.ops.attention.forward_launch_triton")
    at = pytest.importorskip("megatron_iso.ops.attention.attention_triton")
    with pytest.raises(ValueError, match="park=1 must be a bool"):
        launch.AttentionTileConfig(64, 4, 3, park=1)
    parked = {(dt, cfg.park) for dt, cfg in launch.CONFIGS.items()}
    assert parked == {(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)}
    assert not any(cfg.park for cfg in launch.DECODE_CONFIGS.values())
    assert at._tile_record(launch.AttentionTileConfig(64, 4, 3)) == [64, 4, 3]
    assert at._tile_record(launch.AttentionTileConfig(64, 4, 2, park=True)) == [64, 4, 2, "park"]
    consts = at._constants()
    assert consts["bfloat16_tile"] == [64, 4, 2, "park"] and consts["bfloat16_decode_tile"] == [16, 4, 3]
    assert at._tile_record(launch.AttentionTileConfig(16, 4, 2, maxnreg=168)) == [16, 4, 2, "maxnreg=168"]
    assert consts["float32_decode_tile"] == [16, 4, 2, "maxnreg=168"]
    for bad in (8, 256, 1.5, True):
        with pytest.raises(ValueError, match="maxnreg"):
            launch.AttentionTileConfig(16, 4, 2, maxnreg=bad)
