"""Gated DeltaNet ops (CPR): training forward == prefill + decode bit for bit for any prompt length,
chunk alignment and chunked prefill; batch composition invariance; conv state; accuracy against an
fp64 FLA-style recurrence and HF transformers' torch fallbacks; gradients against fp64 autograd; the
native (chunked vs recurrent) gap, measured."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.gdn import (
    GDNLayerState,
    carries_state,
    causal_conv1d,
    gated_delta_rule,
    gated_delta_rule_carry,
    gdn_gates,
    l2norm,
)
from megatron_iso.testing.bits import same_bits
from megatron_iso.testing.gdn_inputs import random_gdn_inputs

HK, HV, D = 2, 4, 8


def _inputs(n: int, seed: int, dk: int = D, dv: int = D):
    return random_gdn_inputs(n, seed, hk=HK, hv=HV, dk=dk, dv=dv)


def _state(slots: int, chunk: int, dk: int = D, dv: int = D) -> GDNLayerState:
    return GDNLayerState.allocate(
        slots,
        conv_dim=4,
        conv_kernel=4,
        key_heads=HK,
        value_heads=HV,
        key_dim=dk,
        value_dim=dv,
        chunk=chunk,
        dtype=torch.float32,
    )


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _incremental(x, pieces: list[int], chunk: int, *, profile: str = "correctness", slot: int = 1) -> torch.Tensor:
    """One sequence fed in calls of ``pieces`` tokens (prefill pieces, then 1-token decode steps)."""
    q, k, v, g, beta = x
    st = _state(slot + 1, chunk)
    outs, pos = [], 0
    for n in pieces:
        r = slice(pos, pos + n)
        outs.append(
            gated_delta_rule(
                q[r], k[r], v[r], g[r], beta[r], _cu([n]), chunk=chunk, state=st,
                slots=torch.tensor([slot]), starts=torch.tensor([pos]), profile=profile,
            )
        )  # fmt: skip
        pos += n
    return torch.cat(outs)


def _train(x, chunk: int, profile: str = "correctness") -> torch.Tensor:
    return gated_delta_rule(*x, _cu([x[0].shape[0]]), chunk=chunk, profile=profile)


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9, 19])
def test_prefill_then_decode_equals_training_forward_chunk8(prompt_len):
    x = _inputs(prompt_len + 12, seed=prompt_len)
    full = _train(x, 8)
    inc = _incremental(x, [prompt_len] + [1] * 12, 8)
    assert same_bits(full, inc), f"max |d| {(full - inc).abs().max():.3e}"


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 130])
def test_prefill_then_decode_equals_training_forward_chunk64(prompt_len):
    # Decode runs past the next chunk boundary (a resync) for every prompt length.
    total = (prompt_len // 64 + 1) * 64 + 2
    x = _inputs(total, seed=100 + prompt_len)
    full = _train(x, 64)
    inc = _incremental(x, [prompt_len] + [1] * (total - prompt_len), 64)
    assert same_bits(full, inc), f"max |d| {(full - inc).abs().max():.3e}"


@pytest.mark.parametrize("pieces", [[3, 5, 9], [8, 8, 1, 7], [1, 1, 13, 2, 4], [20], [2, 15, 6]])
def test_chunked_prefill_any_pieces(pieces):
    x = _inputs(sum(pieces), seed=7)
    assert same_bits(_train(x, 8), _incremental(x, pieces, 8))


def test_batch_composition_and_mixed_positions():
    """Sequences at different positions (mid-chunk, closing a chunk, fresh) in one call == each alone."""
    chunk, lens, prev = 8, [5, 11, 1, 3], [3, 0, 7, 8]  # tokens already processed per sequence
    seqs = [_inputs(p + n, seed=20 + i) for i, (p, n) in enumerate(zip(prev, lens, strict=True))]
    st = _state(4, chunk)
    alone = []
    for i, x in enumerate(seqs):
        alone.append(_incremental(x, [prev[i], lens[i]] if prev[i] else [lens[i]], chunk, slot=i)[prev[i] :])
        if prev[i]:  # warm slot i of the shared state with the first call
            r = slice(0, prev[i])
            gated_delta_rule(*(t[r] for t in x), _cu([prev[i]]), chunk=chunk, state=st,
                             slots=torch.tensor([i]), starts=torch.tensor([0]))  # fmt: skip
    order = [2, 0, 3, 1]
    cat = [torch.cat([seqs[i][j][prev[i] :] for i in order]) for j in range(5)]
    out = gated_delta_rule(*cat, _cu([lens[i] for i in order]), chunk=chunk, state=st,
                           slots=torch.tensor(order), starts=torch.tensor([prev[i] for i in order]))  # fmt: skip
    got = out.split([lens[i] for i in order])
    for j, i in enumerate(order):
        assert same_bits(got[j], alone[i]), f"sequence {i}"


def test_training_forward_packing_invariance():
    xs = [_inputs(n, seed=40 + n) for n in (13, 1, 22)]
    packed = gated_delta_rule(*(torch.cat([x[j] for x in xs]) for j in range(5)), _cu([13, 1, 22]), chunk=8)
    for x, got in zip(xs, packed.split([13, 1, 22]), strict=True):
        assert same_bits(_train(x, 8), got)


def test_carry_cut_at_a_chunk_boundary_equals_one_call():
    """The rule cut (as context parallelism cuts it) at sequence 1's chunk boundary 16 (row 21): the first call runs
    past the cut into the open chunk, the second restarts at the boundary from the first's exit state. Every row has
    one call's bits; the gradients, through the carried state and the rows both calls read, are one call's to 1e-6."""
    x = _inputs(32, seed=61)
    leaves = [t.clone().requires_grad_(True) for t in x]
    w = torch.randn(32, HV, D, generator=torch.Generator().manual_seed(2))
    whole = gated_delta_rule(*leaves, _cu([5, 27]), chunk=8)
    (whole * w).sum().backward()
    cut = [t.clone().requires_grad_(True) for t in x]
    zeros = torch.zeros(2, HV, D, D)
    first, exits = gated_delta_rule_carry(*(t[:24] for t in cut), _cu([5, 19]), zeros, chunk=8)
    second, last = gated_delta_rule_carry(*(t[21:] for t in cut), _cu([11]), exits[1:], chunk=8)
    got = torch.cat([first[:21], second])
    assert same_bits(got, whole) and last.shape == (1, HV, D, D)
    (got * w).sum().backward()
    for name, a, b in zip("qkvgb", cut, leaves, strict=True):
        assert float((a.grad - b.grad).abs().max() / b.grad.abs().max()) < 1e-6, name
    with pytest.raises(ValueError, match=r"entry is torch.float32 \(1, 4, 8, 8\); it must be float32 \[sequences=2"):
        gated_delta_rule_carry(*x, _cu([5, 27]), zeros[:1], chunk=8)
    assert carries_state("cpu", "correctness") and not carries_state("cpu", "performance")
    # the GPU kernels carry in both forms (ops.gdn.triton.carry; tests/gpu/test_gdn_triton_carry.py), native never
    assert carries_state("cuda", "correctness", "chunk", "bf16") and carries_state("cuda", "correctness")
    assert not carries_state("cuda", "performance")
    with pytest.raises(ValueError, match="no implementation on cpu with profile 'performance'"):
        gated_delta_rule_carry(*x, _cu([5, 27]), zeros, chunk=8, profile="performance")


def _naive64(q, k, v, g, beta):
    """FLA's naive recurrent gated delta rule (decay, then delta update, then read) in float64."""
    rep = v.shape[1] // k.shape[1]
    q = q.double().repeat_interleave(rep, 1) * q.shape[-1] ** -0.5
    k = k.double().repeat_interleave(rep, 1)
    s = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        u = (v[t].double() - (s * k[t, :, :, None]).sum(1)) * beta[t].double()[:, None]
        s = s + k[t, :, :, None] * u[:, None, :]
        out.append((s * q[t, :, :, None]).sum(1))
    return torch.stack(out)


def test_accuracy_against_fp64_recurrence_and_hf():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    x = _inputs(150, seed=5, dk=16, dv=16)
    ref = _naive64(*x)
    iso = _train(x, 64)
    err = float((iso.double() - ref).abs().max())
    q, k, v, g, beta = (t[None] for t in x)
    hf_rec, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta)
    hf_chunk, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)
    err_hf_rec = float((iso - hf_rec[0]).abs().max())
    err_hf_chunk = float((iso - hf_chunk[0]).abs().max())
    print(f"iso CPR vs fp64 recurrence {err:.2e}, vs HF recurrent {err_hf_rec:.2e}, vs HF chunked {err_hf_chunk:.2e}")
    assert err < 2e-6 and err_hf_rec < 5e-6 and err_hf_chunk < 5e-6


def test_gradients_match_fp64_autograd():
    q, k, v, g, beta = _inputs(21, seed=9)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    leaves64 = [t.double().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    w = torch.randn(21, HV, D, generator=torch.Generator().manual_seed(1))
    (gated_delta_rule(*leaves, _cu([13, 8]), chunk=8) * w).sum().backward()
    ref = torch.cat([_naive64(*(t[a:b] for t in leaves64)) for a, b in ((0, 13), (13, 21))])
    (ref * w.double()).sum().backward()
    for name, a, b in zip("qkvgb", leaves, leaves64, strict=True):
        err = float((a.grad.double() - b.grad).abs().max() / b.grad.abs().max())
        assert err < 1e-5, f"grad {name}: relative error {err:.2e}"
    # Deterministic: a second backward gives the same bits.
    again = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    (gated_delta_rule(*again, _cu([13, 8]), chunk=8) * w).sum().backward()
    assert all(same_bits(a.grad, b.grad) for a, b in zip(leaves, again, strict=True))


def test_native_chunk_backward_matches_autograd_of_the_recurrence():
    """The chunk loop's hand-written backward (``native._ChunkRule``) against fp64 autograd of the plain per-token
    recurrence, through every input, the initial state and the final state; a length that is not a multiple of
    the chunk (zero-padded tail), several sequences and heads. Deterministic: a second backward, same bits."""
    from megatron_iso.ops.gdn import native

    gen = torch.Generator().manual_seed(4)
    b, h, n, dk, dv = 2, 3, 37, 8, 6

    def leaves():
        g2 = torch.Generator().manual_seed(11)
        q = torch.randn(b, h, n, dk, generator=g2, dtype=torch.float64) * 0.3
        k = torch.nn.functional.normalize(torch.randn(b, h, n, dk, generator=g2, dtype=torch.float64), dim=-1)
        v = torch.randn(b, h, n, dv, generator=g2, dtype=torch.float64)
        g = -torch.rand(b, h, n, generator=g2, dtype=torch.float64) * 0.5
        beta = torch.rand(b, h, n, generator=g2, dtype=torch.float64)
        s0 = torch.randn(b, h, dk, dv, generator=g2, dtype=torch.float64) * 0.1
        return [t.requires_grad_(True) for t in (q, k, v, g, beta, s0)]

    w_o = torch.randn(b, h, n, dv, generator=gen, dtype=torch.float64)
    w_s = torch.randn(b, h, dk, dv, generator=gen, dtype=torch.float64)
    grads = []
    for rule in (lambda *x: native._chunked(*x, 8), native._recurrent, lambda *x: native._chunked(*x, 8)):
        xs = leaves()
        o, s = rule(*xs)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        grads.append([t.grad for t in xs])
    chunked, recurrent, again = grads
    for name, a, r in zip(("q", "k", "v", "g", "beta", "s0"), chunked, recurrent, strict=True):
        err = float((a - r).abs().max() / r.abs().max())
        assert err < 1e-12, f"grad {name}: relative error {err:.2e}"
    assert all(same_bits(a, c) for a, c in zip(chunked, again, strict=True))


def test_conv_prefill_decode_equals_training_and_matches_torch():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(14, 12, generator=gen).to(dtype), torch.randn(12, 4, generator=gen).to(dtype)
        full = causal_conv1d(x, w, _cu([14]))
        state = torch.zeros(2, 12, 3, dtype=dtype)
        outs, pos = [], 0
        for n in (2, 5, 1, 1, 1, 4):
            outs.append(causal_conv1d(x[pos : pos + n], w, _cu([n]), conv_state=state, slots=torch.tensor([1]),
                                      starts=torch.tensor([pos])))  # fmt: skip
            pos += n
        assert same_bits(full, torch.cat(outs))
        ref = torch.nn.functional.silu(torch.nn.functional.conv1d(x.double().t()[None], w.double()[:, None],
                                                                  padding=3, groups=12)[0, :, :14].t())  # fmt: skip
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert float((full.double() - ref).abs().max()) < tol


def test_gates_and_l2norm_batch_invariant():
    gen = torch.Generator().manual_seed(4)
    a, b, x = torch.randn(33, HV, generator=gen) * 8, torch.randn(33, HV, generator=gen), torch.randn(33, 3, 24)
    al, dt = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    g, beta = gdn_gates(a, b, al, dt)
    n = l2norm(x)
    for i in (0, 17, 32):
        gi, bi = gdn_gates(a[i : i + 1], b[i : i + 1], al, dt)
        assert same_bits(gi[0], g[i]) and same_bits(bi[0], beta[i]) and same_bits(l2norm(x[i : i + 1])[0], n[i])
    ref_g = -al.double().exp() * torch.nn.functional.softplus(a.double() + dt.double())
    assert float(((g.double() - ref_g).abs() / ref_g.abs()).max()) < 2e-7


def test_errors_name_the_problem():
    x = _inputs(4, seed=1)
    with pytest.raises(ValueError, match="need their GDN state"):
        gated_delta_rule(*x, _cu([4]), chunk=8, starts=torch.tensor([3]))
    with pytest.raises(ValueError, match="chunk"):
        gated_delta_rule(*x, _cu([4]), chunk=4, state=_state(1, 8), slots=torch.tensor([0]))


def test_native_gap_is_measured():
    x = _inputs(80, seed=11)
    full = _train(x, 64, "performance")
    inc = _incremental(x, [10] + [1] * 70, 64, profile="performance")
    iso = _train(x, 64)
    gap, ref_gap = float((full - inc).abs().max()), float((iso - _naive64(*x)).abs().max())
    print(f"native GDN training vs prefill+decode max |d| {gap:.3e} (fp32; iso: 0; iso vs fp64 {ref_gap:.2e})")
    assert gap > 0.0


def test_native_batches_sequences_like_one_at_a_time():
    # The native path runs a call's multi-token sequences as one zero-padded batch and its decode
    # steps as another; each sequence (output and state) must be what it is when run alone.
    lens, starts = [13, 1, 40, 1, 0, 7], [0, 5, 0, 9, 3, 2]
    x = _inputs(sum(lens), seed=21)
    cu = _cu(lens)
    slots = torch.tensor([4, 0, 2, 1, 5, 3])
    batched, alone = _state(6, 8), _state(6, 8)
    gen = torch.Generator().manual_seed(5)
    for st in (batched, alone):
        st.running.copy_(torch.randn(st.running.shape, generator=gen.manual_seed(5)))
    out = gated_delta_rule(*x, cu, chunk=8, state=batched, slots=slots, starts=torch.tensor(starts),
                           profile="performance")  # fmt: skip
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        one = gated_delta_rule(*(t[a:b] for t in x), _cu([b - a]), chunk=8, state=alone, slots=slots[i : i + 1],
                               starts=torch.tensor([starts[i]]), profile="performance")  # fmt: skip
        torch.testing.assert_close(out[a:b], one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched.running, alone.running, rtol=1e-5, atol=1e-6)
    assert not torch.equal(batched.running[5], torch.zeros_like(batched.running[5]))  # zero-length: untouched


def test_native_conv_batches_sequences_like_one_at_a_time():
    # Mixed lengths (shorter than the kernel's history, zero-length, resumed and fresh) in one batched call.
    lens, starts = [13, 1, 2, 0, 6], [0, 5, 9, 3, 0]
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(sum(lens), 12, generator=gen), torch.randn(12, 4, generator=gen)
    cu, slots = _cu(lens), torch.tensor([3, 0, 4, 1, 2])
    batched = torch.randn(5, 12, 3, generator=gen)
    alone = batched.clone()
    out = causal_conv1d(x, w, cu, conv_state=batched, slots=slots, starts=torch.tensor(starts), profile="performance")
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        one = causal_conv1d(x[a:b], w, _cu([b - a]), conv_state=alone, slots=slots[i : i + 1],
                            starts=torch.tensor([starts[i]]), profile="performance")  # fmt: skip
        torch.testing.assert_close(out[a:b], one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched, alone, rtol=0, atol=0)  # state rows are copies of inputs


def test_step_layout_is_read_once_per_forward():
    # Every GDN layer of a forward gets the same cu_seqlens / starts tensors: one read-back, not one per layer.
    from megatron_iso.ops.gdn import reference

    cu, starts = _cu([5, 3]), torch.tensor([0, 4])
    reads = []
    real = torch.Tensor.tolist

    def counting(t):
        reads.append(t.shape)
        return real(t)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "tolist", counting)
        for _ in range(3):
            assert reference._starts(cu, starts) == ([0, 5, 8], [0, 4])
        starts.add_(1)  # an in-place change is a new layout
        assert reference._starts(cu, starts) == ([0, 5, 8], [1, 5])
    assert len(reads) == 2
    with pytest.raises(ValueError, match="starts has 1 entries for 2 sequences"):
        reference._starts(cu, torch.tensor([0]))


def test_gpu_only_forms_and_precisions_are_refused_on_cpu():
    """profile.gdn_form / gdn_dot_precision choose GPU kernels; on the CPU reference they are refused, not ignored,
    and form='scan' is the reference itself. The config layer checks their values and names the field."""
    from megatron_iso.ops.gdn import gdn_profile_fields

    x = _inputs(11, 3)
    cu = torch.tensor([0, 11])
    assert same_bits(gated_delta_rule(*x, cu, form="scan", chunk=8), gated_delta_rule(*x, cu, chunk=8))
    for kw in ({"form": "chunk"}, {"dot_precision": "bf16"}):
        with pytest.raises(ValueError, match=r"choose GPU kernels .*only form='scan' with dot_precision=None"):
            gated_delta_rule(*x, cu, chunk=8, **kw)
    assert gdn_profile_fields({"gdn_form": "chunk", "gdn_dot_precision": "bf16"}, "cpu") == ("chunk", "bf16")
    assert gdn_profile_fields({}, "cuda") == ("scan", None)
    with pytest.raises(
        ValueError, match=r"profile.gdn_form='tiles' is not allowed; allowed values: \['scan', 'chunk', 'auto'\]"
    ):
        gdn_profile_fields({"gdn_form": "tiles"}, "cpu")
    with pytest.raises(ValueError, match="profile.gdn_dot_precision=16 must be null or a string"):
        gdn_profile_fields({"gdn_dot_precision": 16}, "cpu")


@pytest.mark.parametrize(
    ("device_class", "profile", "form"),
    [("cuda", "correctness", "chunk"), ("cpu", "correctness", "scan"), ("cuda", "performance", "scan")],
)
def test_auto_form_is_the_form_that_runs_here(device_class, profile, form):
    """gdn_form=auto: the chunk form where the GPU kernels run (cuda, correctness), the scan form, the only one,
    elsewhere; the precision stays as given (null: the resolved form's default)."""
    from megatron_iso.ops.gdn import gdn_choice_runs_here, gdn_profile_fields

    got = gdn_profile_fields({"name": profile, "gdn_form": "auto", "gdn_dot_precision": None}, device_class)
    assert got == (form, None)
    assert gdn_choice_runs_here(*got, device_class, profile)


def test_state_cache_holds_only_its_forms_state():
    """The scan form's decode reads ``running``, the chunk form's ``buf_u`` and ``entry_bf16``: each cache allocates
    what its form reads (the rest empty, slots kept), and an unknown form is named."""
    shape = {"conv_dim": 4, "conv_kernel": 4, "key_heads": HK, "value_heads": HV, "key_dim": D, "value_dim": D,
             "chunk": 8, "dtype": torch.float32}  # fmt: skip
    scan, chunk = (GDNLayerState.allocate(3, form=f, **shape) for f in ("scan", "chunk"))
    assert scan.running.shape == (3, HV, D, D) and scan.buf_u.shape == scan.buf_y.shape == (3, 0, 0, 0)
    assert chunk.running.shape == (3, 0, 0, 0) and chunk.buf_u.shape == chunk.buf_y.shape == (3, 8, HV, D)
    assert scan.entry.shape == chunk.entry.shape == (3, HV, D, D)
    assert scan.entry_bf16.shape == (3, 0, 0, 0) and chunk.entry_bf16.shape == (3, HV, D, D)
    assert chunk.entry_bf16.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"form='tiles' is not allowed; allowed values: \['scan', 'chunk'\]"):
        GDNLayerState.allocate(3, form="tiles", **shape)


def test_state_cache_buffer_dtypes_named_and_checked():
    """``buf_v`` in v's dtype and ``buf_u`` in bf16 halve the bytes a decode step reads; a dtype outside the allowed
    ones is named at allocation, and a ``buf_v`` too narrow for the call's v is refused (its rounding would move the
    chunk's bits when it closes)."""
    shape = {"conv_dim": 4, "conv_kernel": 4, "key_heads": HK, "value_heads": HV, "key_dim": D, "value_dim": D,
             "chunk": 8, "dtype": torch.float32}  # fmt: skip
    st = GDNLayerState.allocate(2, form="chunk", v_dtype=torch.bfloat16, u_dtype=torch.bfloat16, **shape)
    assert st.buf_v.dtype == st.buf_u.dtype == st.buf_y.dtype == torch.bfloat16 and st.buf_k.dtype == torch.float32
    with pytest.raises(ValueError, match=r"v_dtype=torch.int8 is not allowed; allowed values: \[torch.float32"):
        GDNLayerState.allocate(2, v_dtype=torch.int8, **shape)
    with pytest.raises(ValueError, match=r"u_dtype=torch.float16 is not allowed; allowed values: \[torch.float32"):
        GDNLayerState.allocate(2, u_dtype=torch.float16, **shape)
    narrow = GDNLayerState.allocate(2, v_dtype=torch.bfloat16, **shape)
    q, k, v, g, beta = _inputs(5, 3)
    with pytest.raises(ValueError, match=r"state.buf_v is torch.bfloat16, which cannot hold this call's torch.float32"):
        gated_delta_rule(q, k, v, g, beta, _cu([5]), chunk=8, state=narrow, slots=torch.tensor([1]),
                         starts=torch.tensor([0]))  # fmt: skip


def test_bf16_value_buffer_is_bit_neutral():
    """bf16 v buffered in a bf16 ``buf_v``: prefill + decode across a chunk close give the bits of an fp32 buffer
    (the values are the same, widened exactly where they are read), and the buffer holds v exactly."""
    chunk = 8
    x = list(_inputs(2 * chunk + 3, 21))
    x[2] = x[2].bfloat16()
    got = {}
    for v_dtype in (torch.float32, torch.bfloat16):
        st = GDNLayerState.allocate(2, conv_dim=4, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D,
                                    value_dim=D, chunk=chunk, dtype=torch.float32, v_dtype=v_dtype)  # fmt: skip
        outs, pos = [], 0
        for n in [chunk - 3, 1, 1, 1, 1, 1, chunk - 2, 1, 1, 1]:  # closes at 8 (a decode step) and 16 (a prefill)
            r = slice(pos, pos + n)
            outs.append(gated_delta_rule(*(t[r] for t in x), _cu([n]), chunk=chunk, state=st,
                                         slots=torch.tensor([1]), starts=torch.tensor([pos])))  # fmt: skip
            pos += n
        assert pos == 2 * chunk + 3
        got[v_dtype] = (torch.cat(outs), st.entry[1], st.running[1], st.buf_v[1, :3].float())
    for name, a, b in zip(("outputs", "entry", "running", "buf_v"), *got.values(), strict=True):
        assert same_bits(a, b), f"bf16 buf_v moved the bits of {name}"
    assert same_bits(got[torch.bfloat16][3], x[2][-3:].float())
    assert same_bits(got[torch.float32][0], _train(x, chunk)), "prefill + decode vs training"
