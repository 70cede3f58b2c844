"""The split-over-keys decode schedule of the Triton attention under TRITON_INTERPRET=1 (skipped without triton).

Keys are merged in segments of ``SEG_BLOCKS`` kv blocks, in ascending order, by one merge helper that the
one-launch kernel runs in-program and the split schedule's combine kernel runs across programs. Claimed and
checked here bit for bit (bit patterns, never tolerances): a decode step of a batch mixing short and long
sequences, split and unsplit, equals the training forward (varlen) at each sequence's last position, for lengths
on both sides of the 64-key block and 128-key segment boundaries (1, 63, 64, 65, 127, 128, 129, 300), GQA
groups 1, 2 and 4, ungated and gated (per dim, per head), from a contiguous cache and from a paged pool (pool
blocks of 16 and 64 keys, shuffled, NaN where nothing was written) with real and placeholder host starts (a
captured decode graph's plan: the segment axis is sized by the table's capacity and most of its programs find
no segment). Also: the forced split of a training forward (prefill tiles, whose rows end in different segments)
and a split with one segment program per tile walking every segment. The GPU test
(tests/gpu/test_attention_triton.py) holds the same claims on the compiled kernels.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

import torch

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
    D = 16
    case = DecodeCase(GROUP, HKV, GATE, d=D, seed=10 * GROUP + HKV)

    for split in (False, True):
        case.check(case.contiguous(split=split), ("contiguous cache", split))
    # One segment program per (tile, kv head) walks all of a tile's segments.
    call, got = launch.prepare(case.step[0], case.k, case.v, case.gate_step, list(range(case.n + 1)), case.starts,
                               case.cu[:-1], D**-0.5, 64, None, split=True, segment_programs=1)
    call()
    case.check(got, "one segment program")

    for page in (16, 64):
        layer = case.paged_layer(page)
        for split in (False, True, None):
            for placeholder in (False, True):
                case.check(case.paged(layer, placeholder, split=split), ("paged", page, split, placeholder))

    if GATE == "none":  # the forced split of a training forward: prefill tiles, rows ending in other segments
        split_train = at.attention_varlen(case.q, case.k, case.v, torch.tensor(case.cu), gate=case.gate, split=True)
        assert same_bits(split_train, case.train), bit_difference(split_train, case.train)
    print("ok")
    """
)


@pytest.mark.parametrize(
    ("group", "hkv", "gate"),
    [(1, 2, "dim"), (2, 1, "none"), (4, 1, "head")],
    ids=["group1-gate-dim", "group2-ungated", "group4-gate-head"],
)
def test_split_decode_equals_unsplit_and_training(group: int, hkv: int, gate: str) -> None:
    res = run_interpreted(SCRIPT, args=[str(group), str(hkv), gate], timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_split_schedule_choice() -> None:
    """Auto: split only a decode step that leaves SMs idle, spans more than one segment and whose scratch fits;
    forced either way."""
    launch = pytest.importorskip("megatron_iso.ops.attention.forward_launch_triton")
    assert launch.split_schedule(8, 32, True, 132) == 32  # batch 1, 8 kv heads, 4096 keys: one segment each
    assert launch.split_schedule(8, 256, True, 132) == 33  # about two waves; programs walk several segments
    assert launch.split_schedule(132, 32, True, 132) == 0  # the machine is full already
    assert launch.split_schedule(128, 32, True, 132) == 0  # batch 16: most SMs busy already (split measured slower)
    assert launch.split_schedule(33, 32, True, 132) == 8  # a quarter of the SMs: still split, two waves
    assert launch.split_schedule(8, 1, True, 132) == 0  # one segment: nothing to split
    assert launch.split_schedule(8, 32, False, 132) == 0  # prefill / training: one launch unless forced
    assert launch.split_schedule(8, 32, False, 132, split=True) == 32
    assert launch.split_schedule(8, 32, True, 132, split=False) == 0
    assert launch.split_schedule(8, 32, True, 132, scratch_bytes=launch.SPLIT_SCRATCH_BYTES + 1) == 0  # scratch too big
    assert launch.split_schedule(8, 32, True, 132, True, launch.SPLIT_SCRATCH_BYTES + 1) == 32  # forced anyway


def test_split_arguments_refused() -> None:
    """Bad schedule arguments: a clear error naming the field (raised before any launch)."""
    launch = pytest.importorskip("megatron_iso.ops.attention.forward_launch_triton")
    q, k, v = torch.zeros(1, 2, 16), torch.zeros(130, 1, 16), torch.zeros(130, 1, 16)
    args = (q, k, v, None, [0, 1], [129], [0], 0.25, 64, None)
    with pytest.raises(ValueError, match="seg_blocks=0"):
        launch.prepare(*args, seg_blocks=0)
    with pytest.raises(ValueError, match="segment_programs=3 needs split and 1..2"):
        launch.prepare(*args, split=True, segment_programs=3)
    with pytest.raises(ValueError, match="segment_programs=1 needs split"):
        launch.prepare(*args, split=False, segment_programs=1)
    with pytest.raises(ValueError, match="kv_capacity=100 is below a sequence's 130 keys"):
        launch.prepare(*args, kv_capacity=100)
