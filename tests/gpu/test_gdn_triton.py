"""GDN Triton kernels (CPR, GPU correctness profile) on a CUDA device.

Bitwise (int32 views): training forward == prefill(P) + decode for P in {1, C-1, C, C+1, 2C+3}, chunked
prefill pieces, packing, batch composition at mixed positions, a subset of heads (TP), at a small shape
(C=16, Dk=Dv=32) and Qwen3-Next's per-head shape (C=64, Dk=Dv=128), bf16 strided inputs read in-kernel == their
fp32 copies, the state pass's tensor-core dot precisions (tf32x3, tf32) keep training == rollout; conv/gates/l2norm
invariance; a
tiny_hybrid model's training-forward logits == its prefill + decode logits. With tolerances (stated in
each test): outputs and cached states against an fp64 recurrence and the CPU reference, gradients of the Triton
backward per variant against fp64 autograd (deterministic, and the same bits whether the forward kept its states).
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bit_difference, same_bits
from megatron_iso.testing.gdn_inputs import checked_rule_grads, random_gdn_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

HK, HV = 2, 4


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double().to(a.device)).abs().max())


@pytest.fixture(scope="module")
def gt():
    from megatron_iso.ops.gdn.triton import rule

    return rule


@pytest.fixture(scope="module")
def gc():
    from megatron_iso.ops.gdn.triton import tuning

    return tuning


@pytest.fixture(scope="module")
def cg():
    from megatron_iso.ops.gdn.triton import conv_gates

    return conv_gates


def inputs(n: int, seed: int, d: int, hk: int = HK, hv: int = HV, device: str = "cuda"):
    return random_gdn_inputs(n, seed, hk=hk, hv=hv, dk=d, dv=d, device=device)


def cu(lengths: list[int], device: str = "cuda") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)


def new_state(
    slots: int, chunk: int, d: int, hk: int = HK, hv: int = HV, device: str = "cuda", form: str = "scan", **dtypes
):
    from megatron_iso.ops.gdn import GDNLayerState

    st = GDNLayerState.allocate(slots, conv_dim=4, conv_kernel=4, key_heads=hk, value_heads=hv, key_dim=d,
                                value_dim=d, chunk=chunk, dtype=torch.float32, device=device, form=form,
                                **dtypes)  # fmt: skip
    for t in (st.running, st.entry, st.entry_bf16, st.buf_k, st.buf_v, st.buf_g, st.buf_beta, st.buf_u, st.buf_y,
              st.buf_tinv):  # fmt: skip
        t.fill_(float("nan"))  # stale slot content must never be read
    return st


def incremental(gt, x, pieces, chunk, slot=1, st=None, **kw):
    st = st or new_state(slot + 1, chunk, x[2].shape[-1], x[0].shape[1], x[2].shape[1], device=x[0].device.type,
                         form=kw.get("form") or "scan")  # fmt: skip
    outs, pos = [], 0
    dev = x[0].device
    for n in pieces:
        r = slice(pos, pos + n)
        outs.append(
            gt.gated_delta_rule(*(t[r] for t in x), cu([n], dev.type), chunk=chunk, state=st,
                                slots=torch.tensor([slot], device=dev), starts=torch.tensor([pos], device=dev), **kw)
        )  # fmt: skip
        pos += n
    return torch.cat(outs), st


def train(gt, x, chunk):
    return gt.gated_delta_rule(*x, cu([x[0].shape[0]], x[0].device.type), chunk=chunk)


def naive64(q, k, v, g, beta):
    """FLA's naive recurrence in float64 (decay, delta update, read), on the CPU."""
    q, k, v, g, beta = (t.double().cpu() for t in (q, k, v, g, beta))
    rep = v.shape[1] // k.shape[1]
    q = q.repeat_interleave(rep, 1) * q.shape[-1] ** -0.5
    k = k.repeat_interleave(rep, 1)
    s = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = (v[t] - (s * k[t, :, :, None]).sum(1)) * beta[t][:, None]
        s = s + k[t, :, :, None] * u[:, None, :]
        out.append((s * q[t, :, :, None]).sum(1))
    return torch.stack(out), s


SHAPES = [(16, 32), (64, 128)]  # (chunk, Dk = Dv)


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
@pytest.mark.parametrize("p_of", [(0, 1), (1, -1), (1, 0), (1, 1), (2, 3)])  # P = a*C + b: 1, C-1, C, C+1, 2C+3
def test_prefill_then_decode_equals_training_forward(gt, chunk, d, p_of):
    p = p_of[0] * chunk + p_of[1]
    total = (p // chunk + 1) * chunk + 3  # decode crosses the next chunk boundary (a resync)
    x = inputs(total, 100 + p, d)
    full = train(gt, x, chunk)
    inc, st = incremental(gt, x, [p] + [1] * (total - p), chunk)
    assert same_bits(full, inc), f"P={p}: {bit_difference(full, inc)}"
    ref, s64 = naive64(*x)
    # Accuracy (fp32 chunk/scan vs fp64 recurrence): outputs O(1), 2e-5 absolute; running state 2e-5.
    assert maxdiff(full, ref) < 2e-5, f"vs fp64 {maxdiff(full, ref):.2e}"
    assert maxdiff(st.running[1], s64) < 2e-5, f"running state vs fp64 {maxdiff(st.running[1], s64):.2e}"


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
@pytest.mark.parametrize("pieces", [[3, 5, 9], [16, 16, 1, 7], [1, 1, 40, 2, 4], [70], [2, 63, 6, 64, 1]])
def test_chunked_prefill_any_pieces(gt, chunk, d, pieces):
    x = inputs(sum(pieces), 7, d)
    inc, _ = incremental(gt, x, pieces, chunk)
    full = train(gt, x, chunk)
    assert same_bits(full, inc), bit_difference(full, inc)


# The registered default is "ieee/tf32x3" (every other test here runs it); these are the other specs. Sanity bounds
# only (outputs O(1)): accuracy is measured by tools/bench_gdn.py --dot-precision, not claimed here. ieee and tf32x3
# should stay near fp32; tf32 keeps 10 mantissa bits.
DOT_VARIANT_SANITY = {"ieee": 2e-5, "tf32x3": 1e-4, "tf32": 1e-2, "tf32x3/ieee": 1e-4}


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
@pytest.mark.parametrize("prec", sorted(DOT_VARIANT_SANITY))
def test_dot_precision_variant_train_equals_rollout(gt, chunk, d, prec):
    """Every dot precision of the state pass keeps training == prefill + decode (and == chunked prefill) bitwise:
    both sides run the same prep/chain kernel on the same closed chunks (module docstring, "Dot precision")."""
    total = 3 * chunk + 7
    x = inputs(total, 61, d)
    full = gt.gated_delta_rule(*x, cu([total]), chunk=chunk, dot_precision=prec)
    for p in (1, chunk + 1, 2 * chunk + 3):
        inc, _ = incremental(gt, x, [p] + [1] * (total - p), chunk, dot_precision=prec)
        assert same_bits(full, inc), f"{prec} P={p}: {bit_difference(full, inc)}"
    inc, _ = incremental(gt, x, [2, chunk - 1, 6, chunk, total - 2 * chunk - 7], chunk, dot_precision=prec)
    assert same_bits(full, inc), f"{prec} pieces: {bit_difference(full, inc)}"
    default = train(gt, x, chunk)
    assert not same_bits(full, default), f"{prec} gave the default's bits: is the precision reaching the dots?"
    ref, _ = naive64(*x)
    err = maxdiff(full, ref)
    assert err < DOT_VARIANT_SANITY[prec], f"{prec} vs fp64 {err:.2e} (default {maxdiff(default, ref):.2e})"


# Chunk-form outputs (module docstring, "Output forms"): every precision spec, sanity bounds against fp64 as above
# (bf16 operands keep 8 mantissa bits, FLA's class).
# tf32x3 is refused by the chunk form (its row bits moved in the decode step's 16-row tiles at chunk 64, Dk 128).
CHUNK_FORM_SANITY = {"ieee": 2e-5, "tf32": 1e-2, "bf16": 5e-2, "ieee/bf16": 5e-2}


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
@pytest.mark.parametrize("prec", sorted(CHUNK_FORM_SANITY))
def test_chunk_form_train_equals_rollout(gt, chunk, d, prec):
    """Chunk form: training forward == prefill(P) + decode (P around chunk boundaries) == chunked prefill, bitwise,
    and a batch of sequences at mixed positions == each alone. A decode step runs the row kernel (its token's rows
    through 16-row tiles), a longer call the tiles; both give each row the same bits (a tl.dot row's bits do not depend on the
    other rows of its tile at these shapes and launch options)."""
    kw = {"dot_precision": prec, "form": "chunk"}
    total = 3 * chunk + 7
    x = inputs(total, 62, d)
    full = gt.gated_delta_rule(*x, cu([total]), chunk=chunk, **kw)
    for p in (1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3):
        inc, st = incremental(gt, x, [p] + [1] * (total - p), chunk, **kw)
        assert same_bits(full, inc), f"{prec} P={p}: {bit_difference(full, inc)}"
        assert same_bits(st.entry_bf16[1], st.entry[1].bfloat16()), f"P={p}: state.entry_bf16 after decode"
    inc, st = incremental(gt, x, [2, chunk - 1, 6, chunk, total - 2 * chunk - 7], chunk, **kw)
    assert same_bits(full, inc), f"{prec} pieces: {bit_difference(full, inc)}"
    assert same_bits(st.entry_bf16[1], st.entry[1].bfloat16()), "state.entry_bf16 is not state.entry rounded"
    nb = total % chunk
    assert same_bits(st.buf_k[1, :nb], x[1][-nb:]) and same_bits(st.buf_v[1, :nb], x[2][-nb:]), "buffer rows"
    ref, _ = naive64(*x)
    err = maxdiff(full, ref)
    assert err < CHUNK_FORM_SANITY[prec], f"chunk form {prec} vs fp64 {err:.2e}"
    # mixed positions in one call == each alone (prefix call first, then all continue together)
    c = chunk
    lens, prev = [5, 2 * c + 3, 1, 3, 1, c], [3, 0, c - 1, 2 * c, c + 2, 5]
    seqs = [inputs(p + n, 70 + i, d) for i, (p, n) in enumerate(zip(prev, lens, strict=True))]
    alone = [incremental(gt, s, [p, n] if p else [n], c, **kw)[0][p:] for s, p, n in zip(seqs, prev, lens, strict=True)]
    st = new_state(len(lens), c, d, form="chunk")
    for i, s in enumerate(seqs):
        if prev[i]:
            gt.gated_delta_rule(*(t[: prev[i]] for t in s), cu([prev[i]]), chunk=c, state=st,
                                slots=torch.tensor([i], device="cuda"), starts=torch.tensor([0], device="cuda"), **kw)  # fmt: skip
    order = [2, 0, 5, 4, 3, 1]
    cat = [torch.cat([seqs[i][j][prev[i] :] for i in order]) for j in range(5)]
    out = gt.gated_delta_rule(*cat, cu([lens[i] for i in order]), chunk=c, state=st,
                              slots=torch.tensor(order, device="cuda"),
                              starts=torch.tensor([prev[i] for i in order], device="cuda"), **kw)  # fmt: skip
    for part, i in zip(out.split([lens[i] for i in order]), order, strict=True):
        assert same_bits(part, alone[i]), f"{prec} sequence {i}: {bit_difference(part, alone[i])}"


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
@pytest.mark.parametrize("prec", ["bf16", "ieee/bf16"])
def test_bf16_storage_of_intermediates_is_bit_neutral(gt, gc, chunk, d, prec, monkeypatch):
    """With bf16 chain dots, W, KD, u and the entry states are stored as bf16 (``MID_BF16``): the training forward,
    prefill + decode outputs and the state cache are bitwise those of fp32 storage (every consumer is a bf16 dot,
    which rounds an fp32 operand to the same bf16)."""
    kw = {"dot_precision": prec, "form": "chunk"}
    total = 3 * chunk + 7
    x = inputs(total, 63, d)
    got = {}
    for mid in (True, False):
        monkeypatch.setattr(gc, "MID_BF16", mid)
        assert gc.config_for(d, d, chunk, prec, "chunk").mid_dtype == (torch.bfloat16 if mid else torch.float32)
        full = gt.gated_delta_rule(*x, cu([total]), chunk=chunk, **kw)
        inc, st = incremental(gt, x, [chunk + 3, 1, 1, chunk - 5, 1, 1, total - 2 * chunk - 2], chunk, **kw)
        # buf_u rows a prefill copied hold the stored u (bf16 values under MID_BF16): equal as the dots see them
        got[mid] = (full, inc, st.entry[1], st.buf_u[1, : total % chunk].bfloat16())
    for name, a, b in zip(("train", "prefill + decode", "state.entry", "state.buf_u"), *got.values(), strict=True):
        assert same_bits(a, b), f"{prec} {name}: bf16 storage moved bits, {bit_difference(a, b)}"
    assert same_bits(got[True][0], got[True][1]), "train vs prefill + decode"


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
@pytest.mark.parametrize("variant", ["scan", "chunk:bf16"])
def test_narrow_state_buffers_are_bit_neutral(gt, gc, chunk, d, variant):
    """buf_v in bf16 v's own dtype and (chunk form, bf16 chain dots) buf_u in bf16, as the model allocates them: a
    prefill's buffer copy and the decode steps read and write the same values, so the outputs and the state are the
    fp32 buffers' bits, and training's."""
    form, _, prec = variant.partition(":")
    kw = {"form": form, **({"dot_precision": prec} if prec else {})}
    total = 3 * chunk + 7
    nb = total % chunk  # the open chunk's tokens at the end
    x = list(inputs(total, 65, d))
    x[2] = x[2].bfloat16()
    narrow = {"v_dtype": torch.bfloat16, "u_dtype": gc.state_u_dtype(form, prec)}
    got = {}
    for dtypes in ({}, narrow):
        st = new_state(2, chunk, d, form=form, **dtypes)
        inc, st = incremental(gt, x, [chunk + 3, 1, 1, chunk - 5, 1, 1, total - 2 * chunk - 2], chunk, st=st, **kw)
        got[bool(dtypes)] = (inc, st.entry[1], st.running[1], st.buf_u[1, :nb].bfloat16(), st.buf_v[1, :nb].float())
    assert got[True][4].numel() and same_bits(got[True][4], x[2][-nb:].float())
    for name, a, b in zip(("outputs", "entry", "running", "buf_u", "buf_v"), *got.values(), strict=True):
        assert same_bits(a, b), f"{variant} narrow buffers: {name}, {bit_difference(a, b)}"
    full = gt.gated_delta_rule(*x, cu([total]), chunk=chunk, **kw)
    assert same_bits(got[True][0], full), f"{variant} train vs prefill + decode: {bit_difference(got[True][0], full)}"


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
def test_bf16_strided_inputs_read_in_kernel(gt, chunk, d):
    """v as the model passes it (a bf16 column slice of the conv output, row stride > Hv*Dv) and bf16 q/k are
    read and widened in-kernel: the same bits as their fp32 copies (a kernel compiled for other pointer dtypes
    and strides), in training and in prefill + decode; the decode step's buffer rows are the exact values."""
    x = inputs(2 * chunk + 5, 51, d)
    t = x[0].shape[0]
    wide = torch.cat([torch.zeros(t, 24, device="cuda"), x[2].reshape(t, -1)], 1).bfloat16()
    v16 = wide[:, 24:].reshape(x[2].shape)
    q16, k16 = x[0].bfloat16(), x[1].bfloat16()
    x16 = (q16, k16, v16, x[3], x[4])
    full = train(gt, (q16.float(), k16.float(), v16.float(), x[3], x[4]), chunk)
    assert same_bits(train(gt, x16, chunk), full), f"train: {bit_difference(train(gt, x16, chunk), full)}"
    inc, st = incremental(gt, x16, [chunk - 3] + [1] * (t - chunk + 3), chunk)
    assert same_bits(inc, full), f"prefill + decode: {bit_difference(inc, full)}"
    nb = t % chunk
    assert same_bits(st.buf_v[1, :nb], v16[-nb:].float()) and same_bits(st.buf_k[1, :nb], k16[-nb:].float())


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
def test_state_cache_matches_cpu_reference(gt, chunk, d):
    from megatron_iso.ops.gdn import reference as ref

    pieces = [chunk + 5, 3, chunk - 1, 1, 1]
    x = inputs(sum(pieces), 8, d)
    out, st = incremental(gt, x, pieces, chunk)
    xc = tuple(t.cpu() for t in x)
    rout, rst = incremental(ref, xc, pieces, chunk)
    # fp32 GPU kernels vs the CPU reference's tree sums: 2e-5 absolute (outputs and states O(1)).
    assert maxdiff(out, rout) < 2e-5
    assert maxdiff(st.running[1], rst.running[1]) < 2e-5 and maxdiff(st.entry[1], rst.entry[1]) < 2e-5
    nb = sum(pieces) % chunk
    for name in ("buf_k", "buf_v", "buf_g", "buf_beta"):  # the buffered tokens are exact copies
        assert same_bits(getattr(st, name)[1, :nb].cpu(), getattr(rst, name)[1, :nb]), name


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
def test_batch_composition_and_packing(gt, chunk, d):
    """Sequences at mixed positions (mid-chunk, closing a chunk, fresh, several chunks) in one call ==
    each alone; a decode step of a sequence alone == inside a batch of 7."""
    c = chunk
    lens, prev = [5, 2 * c + 3, 1, 3, 1, 1, c], [3, 0, c - 1, 2 * c, 7, c + 2, 5]
    seqs = [inputs(p + n, 20 + i, d) for i, (p, n) in enumerate(zip(prev, lens, strict=True))]
    alone = [incremental(gt, x, [p, n] if p else [n], c)[0][p:] for x, p, n in zip(seqs, prev, lens, strict=True)]
    st = new_state(len(lens), c, d)
    for i, x in enumerate(seqs):
        if prev[i]:
            r = slice(0, prev[i])
            gt.gated_delta_rule(*(t[r] for t in x), cu([prev[i]]), chunk=c, state=st,
                                slots=torch.tensor([i], device="cuda"), starts=torch.tensor([0], device="cuda"))  # fmt: skip
    order = [2, 0, 6, 4, 3, 1, 5]
    cat = [torch.cat([seqs[i][j][prev[i] :] for i in order]) for j in range(5)]
    out = gt.gated_delta_rule(*cat, cu([lens[i] for i in order]), chunk=c, state=st,
                              slots=torch.tensor(order, device="cuda"),
                              starts=torch.tensor([prev[i] for i in order], device="cuda"))  # fmt: skip
    for part, i in zip(out.split([lens[i] for i in order]), order, strict=True):
        assert same_bits(part, alone[i]), f"sequence {i}: {bit_difference(part, alone[i])}"
    xs = [inputs(n, 40 + n, d) for n in (13, 1, 2 * c + 5, c)]
    packed = gt.gated_delta_rule(*(torch.cat([x[j] for x in xs]) for j in range(5)), cu([13, 1, 2 * c + 5, c]), chunk=c)
    for x, part in zip(xs, packed.split([13, 1, 2 * c + 5, c]), strict=True):
        assert same_bits(train(gt, x, c), part)


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
def test_heads_subset_tp_sharding(gt, chunk, d):
    """A TP rank's heads (key heads [0, 2), their value heads) give the same bits as in the full call."""
    x = inputs(2 * chunk + 9, 31, d, hk=4, hv=8)
    full = train(gt, x, chunk)
    for lo in (0, 2):
        shard = (x[0][:, lo : lo + 2], x[1][:, lo : lo + 2], x[2][:, 2 * lo : 2 * lo + 4], x[3][:, 2 * lo : 2 * lo + 4],
                 x[4][:, 2 * lo : 2 * lo + 4])  # fmt: skip
        assert same_bits(train(gt, shard, chunk), full[:, 2 * lo : 2 * lo + 4]), f"key heads {lo}.."
        inc, _ = incremental(gt, shard, [chunk - 2, 1, 1, 1, chunk, 1, 1, 1, 1, 1, 1, 1, 1], chunk)
        assert same_bits(inc, full[:, 2 * lo : 2 * lo + 4]), f"key heads {lo}.., decode"


def test_conv_gates_l2norm_invariance_and_accuracy(cg):
    from megatron_iso.ops.gdn import reference as ref

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(40, 600, generator=gen).to(dtype).cuda()
        w = torch.randn(600, 4, generator=gen).to(dtype).cuda()
        full = cg.causal_conv1d(x, w, cu([40]))
        cs = torch.full((3, 600, 3), float("nan"), dtype=dtype, device="cuda")
        outs, pos = [], 0
        for n in (2, 17, 1, 1, 1, 18):
            outs.append(cg.causal_conv1d(x[pos : pos + n], w, cu([n]), conv_state=cs,
                                         slots=torch.tensor([2], device="cuda"),
                                         starts=torch.tensor([pos], device="cuda")))  # fmt: skip
            pos += n
        assert same_bits(full, torch.cat(outs)), f"conv prefill/decode {dtype}"
        assert same_bits(cs[2], x[-3:].t()), "conv state"
        two = cg.causal_conv1d(torch.cat([x[:5], x]), w, cu([5, 40]))
        assert same_bits(two[5:], full) and same_bits(two[:5], full[:5]), "conv packing"
        rc = ref.causal_conv1d(x.cpu(), w.cpu(), cu([40], "cpu"))
        # |d| <= rtol |ref| + atol. fp32: 1e-5, 1e-6; bf16: the output rounding of either side, 2 ulps (2^-7), 1e-3
        rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2**-7, 1e-3)
        d = (full.float().cpu() - rc.float()).abs()
        assert bool((d <= rtol * rc.float().abs() + atol).all()), f"conv vs reference: max |d| {float(d.max()):.2e}"
    a, b = (torch.randn(300, 32, generator=gen) * 8).cuda(), torch.randn(300, 32, generator=gen).cuda()
    al, dt = torch.randn(32, generator=gen).cuda(), torch.randn(32, generator=gen).cuda()
    xn = torch.randn(300, 16, 128, generator=gen).cuda()
    g, beta = cg.gdn_gates(a, b, al, dt)
    nrm = cg.l2norm(xn)
    for i in (0, 17, 299):
        gi, bi = cg.gdn_gates(a[i : i + 1], b[i : i + 1], al, dt)
        assert same_bits(gi[0], g[i]) and same_bits(bi[0], beta[i]) and same_bits(cg.l2norm(xn[i : i + 1])[0], nrm[i])
    rg, rb = ref.gdn_gates(a.cpu(), b.cpu(), al.cpu(), dt.cpu())
    # fp32 tl.exp/tl.log vs the fp64-composed reference: 2e-6 relative on g, 1e-6 absolute on beta.
    assert float(((g.cpu() - rg).abs() / rg.abs()).max()) < 2e-6 and maxdiff(beta, rb) < 1e-6
    assert maxdiff(nrm, ref.l2norm(xn.cpu())) < 1e-6


# The Triton backward's dots run at the forward chain's precision: relative error bounds (to the largest gradient)
# against fp64 autograd of the CPU reference, per variant (None: the registered scan form).
BACKWARD_TOLERANCE = {None: 1e-4, "chunk:ieee": 1e-4, "chunk:tf32": 1e-2, "chunk:bf16": 3e-2}
BACKWARD_LENGTHS = {16: [21, 29, 16], 64: [150, 64, 37]}


@pytest.mark.parametrize(("chunk", "d"), SHAPES)
@pytest.mark.parametrize("variant", list(BACKWARD_TOLERANCE), ids=str)
def test_backward_deterministic_and_close_to_reference(gt, chunk, d, variant):
    from megatron_iso.ops.gdn import reference as ref

    form, _, prec = (variant or "scan:").partition(":")
    kw = {"chunk": chunk, "form": form, "dot_precision": prec or None}
    lengths = BACKWARD_LENGTHS[chunk]
    n = sum(lengths)
    x = inputs(n, 9, d)
    w = torch.randn(n, HV, d, generator=torch.Generator().manual_seed(1)).cuda()
    grads = checked_rule_grads(gt.gated_delta_rule, x, cu(lengths), w, **kw)
    lr = [t.cpu().double().requires_grad_(True) for t in x]
    (ref.gated_delta_rule(*lr, cu(lengths, "cpu"), chunk=chunk) * w.cpu().double()).sum().backward()
    for name, a, r in zip("qkvgb", grads, lr, strict=True):
        rel = maxdiff(a, r.grad) / float(r.grad.abs().max())
        assert rel < BACKWARD_TOLERANCE[variant], f"grad {name}: relative error {rel:.2e}"


def test_dispatch_selects_triton():
    from megatron_iso.ops import gdn
    from megatron_iso.registry import lookup

    x = inputs(5, 1, 32)
    out = gdn.gated_delta_rule(*x, cu([5]), chunk=16)
    assert out.is_cuda and lookup("gated_delta_rule", "cuda", "correctness").impl_id == "gated_delta_rule.triton"
    for op in ("gdn_conv1d", "gdn_gates", "gdn_l2norm"):
        assert lookup(op, "cuda", "correctness").impl_id == f"{op}.triton"


def _hybrid_prefill_decode(prompt_len: int, pieces: list[int], decode: int, extra: list[str] | tuple[str, ...] = ()):
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gdn import allocate_gdn_cache
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.ops.attention.kv_cache import KVCache
    from megatron_iso.settings.compose import load_config

    # tiny_hybrid is fp32, and the fp32 leaf-tree GEMM on the GPU needs K/leaves to be a multiple of its
    # block_k (32). Its column-parallel GEMMs (one leaf) have K = hidden = 64; its row-parallel ones
    # (attention out, MLP fc2, GDN out) all have K = 128, so 4 leaves (32 deep) instead of the default 8.
    overrides = ["model=tiny_hybrid", "profile.gdn_chunk=16", "profile.leaves=4", "profile.tp_domain=[1,2,4]", *extra]
    tc = transformer_config(load_config(overrides))
    assert tc.iso_leaves == 4
    model = build_model(tc, random_hf_state_dict(tc, seed=7)).eval()
    seq = torch.randint(0, tc.vocab_size, (prompt_len + decode,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.forward_packed(*pack([seq], device="cuda"))
        kv = KVCache.allocate(tc.num_layers, 2, 128, tc.num_query_groups, tc.kv_channels, dtype=tc.params_dtype,
                              device="cuda")  # fmt: skip
        gdn = allocate_gdn_cache(tc, 2, device="cuda")
        out, pos = [], 0
        for n in [*pieces, *([1] * (len(seq) - sum(pieces)))]:
            case = "decode" if n == 1 and pos >= prompt_len else "prefill"
            ids, batch = pack([seq[pos : pos + n]], start_positions=[pos], case=case, kv_cache=kv, gdn_cache=gdn,
                              slots=[1], device="cuda")  # fmt: skip
            out.append(model.forward_packed(ids, batch))
            kv.advance([1], [n])
            pos += n
    return full, torch.cat(out)


@pytest.mark.parametrize(
    "gdn",
    [["profile.gdn_form=scan"], ["profile.gdn_form=chunk", "profile.gdn_dot_precision=bf16"], []],
    ids=["scan", "chunk", "auto"],
)
@pytest.mark.parametrize(("prompt_len", "pieces"), [(15, [15]), (16, [16]), (21, [5, 11, 5])])
def test_tiny_hybrid_training_forward_equals_prefill_decode(prompt_len, pieces, gdn):
    """The model path: profile.gdn_form / gdn_dot_precision reach the GDN kernels (auto, the default: the chunk form
    at its default bf16 dots on cuda)."""
    from megatron_iso.parallel.world import single_process_world

    with single_process_world():
        full, cached = _hybrid_prefill_decode(prompt_len, pieces, 20, gdn)
    assert same_bits(full, cached), bit_difference(full, cached)
