"""The GDN Triton package's host side (no kernels): the call plan (which chunks, chains and buffer copies a call gets,
per output form) and the backward's key-head sum. Bitwise behaviour is tested under the interpreter
(test_gdn_triton_interpret.py) and on the GPU; these pin the tables those kernels read (columns: ``_prep_kernel``'s
and ``_chain_kernel``'s docstrings)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_iso.ops.gdn.triton import plan as gp
from megatron_iso.ops.gdn.triton import rule as gt
from megatron_iso.ops.gdn.triton import tuning as gc

C = 8
CPU = torch.device("cpu")


def plan(lengths, starts=None, slots=None, form="chunk", has_state=True, slot_count=4):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    st = None if starts is None else torch.tensor(starts)
    sl = None if slots is None else torch.tensor(slots)
    return gp._plan(cu, st, sl, C, has_state, CPU, slot_count, form)


def test_chunk_form_decode_step_mid_chunk_and_at_close():
    # slot 2 at position 13 (chunk 1, 5 buffered), slot 0 at position 7 (its token closes chunk 0). Column 0 is the
    # packed row chunk token 0 would have: the token's packed row minus the tokens buffered before it.
    p = plan([1, 1], starts=[13, 7], slots=[2, 0])
    assert p.chunks.tolist() == [[0 - 5, 5, 2 * C, 6, 1], [1 - 7, 7, 0, 8, 0]]
    # chains: (first chunk, count, entry kind, slot, write back, last open)
    assert p.chains.tolist() == [[0, 1, 1, 2, 0, 1], [1, 1, 1, 0, 1, 0]]
    assert p.buffers  # the open chunk's token goes to the buffer


def test_chunk_form_prefill_from_mid_chunk_lists_every_chunk():
    # 3 buffered tokens, then 14 new: rows 0..4 close chunk 0, rows 5..12 fill chunk 1, row 13 opens chunk 2
    p = plan([14], starts=[3], slots=[1])
    assert p.chunks.tolist() == [[-3, 3, C, 8, 0], [5, 0, C, 8, 0], [13, 0, C, 1, 1]]
    assert p.chains.tolist() == [[0, 3, 1, 1, 1, 1]]
    scan = plan([14], starts=[3], slots=[1], form="scan")
    assert scan.chunks.tolist() == [[-3, 3, C, 8, 0], [5, 0, C, 8, 0]]  # the scan form preps closing chunks only
    assert scan.chains.tolist() == [[0, 2, 1, 1, 1, 0]]


def test_training_plan_without_state_has_no_buffer_copies():
    p = plan([5, 16], has_state=False)
    assert p.chunks.tolist() == [[0, 0, 0, 5, 0], [5, 0, 0, 8, 0], [13, 0, 0, 8, 0]]
    assert p.chains.tolist() == [[0, 1, 0, 0, 0, 1], [1, 2, 0, 0, 0, 0]]
    assert not p.buffers


def test_fresh_sequence_writes_its_zero_entry_back():
    p = plan([3], starts=[0], slots=[3])  # a fresh slot: the next step reads the open chunk's (zero) entry state
    assert p.chains.tolist() == [[0, 1, 0, 3, 1, 1]]


def test_bad_form_and_precision_are_named():
    with pytest.raises(ValueError, match="form='spiral' must be one of"):
        gc.config_for(8, 8, C, "ieee", "spiral")
    with pytest.raises(ValueError, match="form='chunk' with dot_precision='tf32x3'"):
        gc.config_for(8, 8, C, "tf32x3", "chunk")


def test_decode_dv_block_is_one_for_every_precision(monkeypatch):
    # without fp contraction the ieee chunk form is bitwise at the tensor-core precisions' block (64) too
    monkeypatch.setattr(gc, "DECODE_BV", 64)
    for prec in ("ieee", "bf16", "ieee/bf16", "tf32"):
        assert gc.config_for(128, 128, 64, prec, "chunk").decode_bv == 64, prec
    assert gc.config_for(32, 32, 16, "tf32", "chunk").decode_bv == 32  # never wider than Dv


@pytest.mark.parametrize("rep", [1, 2, 3])
def test_key_head_sum_adds_a_key_heads_planes_in_order(rep):
    """The backward's dq/dk per value head, plane r holding value head ``j * rep + r`` of key head j, -> per key head:
    planes added left to right (bit patterns of an explicit fp32 loop)."""
    from megatron_iso.ops.gdn.triton.backward import key_head_sum

    planes = torch.randn(rep, 7, 3, 5)
    want = planes[0].clone()
    for r in range(1, rep):
        want = want + planes[r]
    got = key_head_sum(planes)
    assert got.shape == (7, 3, 5)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_state_buffers_checked_before_any_launch():
    """The state the kernels read and write in place: each buffer contiguous, the fixed ones in their dtype, buf_v
    able to hold the call's v and buf_u in fp32 or the dtype the chunk form stores u in; each refusal names it."""
    from megatron_iso.ops.gdn import GDNLayerState
    from megatron_iso.testing.gdn_inputs import random_gdn_inputs

    x = random_gdn_inputs(3, 1, hk=2, hv=4, dk=16, dv=16)
    shape = {"conv_dim": 4, "conv_kernel": 4, "key_heads": 2, "value_heads": 4, "key_dim": 16, "value_dim": 16,
             "chunk": 16, "dtype": torch.float32, "form": "chunk"}  # fmt: skip

    def call(st, precision="bf16"):
        gt.gated_delta_rule(*x, torch.tensor([0, 3]), chunk=16, state=st, slots=torch.tensor([0]),
                            starts=torch.tensor([0]), form="chunk", dot_precision=precision)  # fmt: skip

    st = GDNLayerState.allocate(1, **shape)
    st.buf_k = st.buf_k.transpose(2, 3)
    with pytest.raises(ValueError, match=r"state.buf_k must be contiguous torch.float32"):
        call(st)
    st = GDNLayerState.allocate(1, **shape)
    st.buf_v = st.buf_v.transpose(2, 3)
    with pytest.raises(ValueError, match=r"state.buf_v must be contiguous$"):
        call(st)
    with pytest.raises(ValueError, match=r"state.buf_v is torch.bfloat16, which cannot hold this call's torch.float32"):
        call(GDNLayerState.allocate(1, v_dtype=torch.bfloat16, **shape))
    with pytest.raises(ValueError, match=r"state.buf_u is torch.bfloat16, but dot_precision='tf32' stores u and Y as"):
        call(GDNLayerState.allocate(1, u_dtype=torch.bfloat16, **shape), "tf32")
    st = GDNLayerState.allocate(1, **shape)
    st.buf_y = st.buf_y.bfloat16()
    with pytest.raises(ValueError, match=r"state.buf_y is torch.bfloat16, but dot_precision='tf32' stores u and Y as"):
        call(st, "tf32")
    st = GDNLayerState.allocate(1, **shape)
    st.buf_y = st.buf_y.transpose(2, 3)
    with pytest.raises(ValueError, match=r"state.buf_y must be contiguous$"):
        call(st)


def test_decode_plan_from_device_tensors_is_the_host_plan():
    """A chunk-form decode step's plan, built by tensor ops from starts and slots (what a CUDA graph records), has the
    host plan's chunk and chain tables: tokens mid-chunk, closing a chunk, opening one, and fresh (position 0)."""
    starts = [13, 7, 0, 8, 1, 23, 15, 6]
    slots = [2, 0, 5, 1, 7, 3, 6, 4]
    host = plan([1] * len(starts), starts=starts, slots=slots, slot_count=8)
    cu = torch.arange(len(starts) + 1)
    for check in (True, False):
        dev = gp._decode_plan(cu, torch.tensor(starts), torch.tensor(slots), C, CPU, 8, check)
        assert (dev.n, dev.nchunks, dev.nchains) == (host.n, host.nchunks, host.nchains)
        assert torch.equal(dev.chunks, host.chunks) and torch.equal(dev.chains, host.chains)
        assert dev.chunks.dtype == dev.chains.dtype == torch.int32
    fresh = gp._decode_plan(cu[:3], None, torch.tensor([3, 1]), C, CPU, 4, True)  # no starts: every row at 0
    host = plan([1, 1], starts=[0, 0], slots=[3, 1])
    assert torch.equal(fresh.chunks, host.chunks) and torch.equal(fresh.chains, host.chains)


@pytest.mark.parametrize(
    ("cu", "starts", "slots", "pattern"),
    [
        ([0, 0, 2], [3, 4], [0, 1], "one token per sequence"),
        ([0, 1, 2], [3, -1], [0, 1], "starts must be >= 0"),
        ([0, 1, 2], [3, 4], [0, 4], r"slots \[0, 4\] outside the state cache's 4 slots"),
    ],
)
def test_decode_plan_outside_a_capture_checks_the_call(cu, starts, slots, pattern):
    with pytest.raises(ValueError, match=pattern):
        gp.decode_plan(torch.tensor(cu), torch.tensor(starts), torch.tensor(slots), C, CPU, 4)
