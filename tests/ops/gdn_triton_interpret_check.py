"""Checks of the GDN Triton kernels under TRITON_INTERPRET=1, run as a script by
tests/ops/test_gdn_triton_interpret.py (a subprocess: the variable must be set before triton is imported).

Tiny shapes (chunk 8, Dk = Dv = 8, Dv split into blocks of 4). Bitwise: training forward == prefill(P) +
decode for P in {1, C-1, C, C+1, 2C+3}, chunked prefill pieces, packing, batch composition with
sequences at mixed positions, a subset of heads (TP), a bf16 strided v (read in-kernel) == its fp32 copy;
the state pass's dot-precision variants (tf32x3, tf32); chunk 16 (four blocks of the prep kernel's triangular
inverse); conv, gates, l2norm. Launches: a mid-chunk decode step launches the scan kernel only (scan form), or
the decode prep and row kernels (chunk form: T^{-1}'s row from the cached rows, no buffer kernel). Errors: an
unknown dot precision names the allowed ones. Tolerances: the rule and the
state cache vs the CPU reference (1e-5), conv vs fp64 F.conv1d, gates/l2norm vs the reference (1e-6),
gradients (the Triton backward, both forms, Dk != Dv) vs fp64 autograd of the reference (1e-5 relative), and
bitwise the same over two backward runs.

triton 3.6's interpreter cannot loop to a run-time bound with numpy 2.x (``int()`` of a 1-element
array); the first lines patch that one conversion. Its fp32 -> bf16 ``.to()`` truncates where the GPU rounds to
nearest even (:func:`triton_bf16`); the kernels' bf16 values are compared with that, not with torch's rounding.

Parts (``PARTS``; the command line names which to run, default all): ``scan`` and ``chunk`` (the rule per form),
``bf16_storage``, ``conv``, ``gates``, ``grads``. The
pytest wrapper runs them in concurrent children, since the interpreter keeps one core busy and the check took 12
minutes in one process.
"""

# ruff: noqa: E402
from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

allow_runtime_loop_bounds()

import functools
import sys
import time

import torch
import triton
import triton.language as tl

from megatron_iso.ops.gdn import GDNLayerState
from megatron_iso.ops.gdn import reference as ref
from megatron_iso.ops.gdn.triton import conv_gates as cg
from megatron_iso.ops.gdn.triton import rule as gt
from megatron_iso.ops.gdn.triton import tuning as gc
from megatron_iso.testing.bits import same_bits
from megatron_iso.testing.gdn_inputs import checked_rule_grads, random_gdn_inputs

HK, HV, D, C = 2, 4, 8, 8
t_start = time.time()


def inputs(n, seed, hk=HK, hv=HV):
    return random_gdn_inputs(n, seed, hk=hk, hv=hv, dk=D, dv=D)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def new_state(slots, hk=HK, hv=HV, form=None, **dtypes):
    return GDNLayerState.allocate(
        slots,
        conv_dim=4,
        conv_kernel=4,
        key_heads=hk,
        value_heads=hv,
        key_dim=D,
        value_dim=D,
        chunk=C,
        dtype=torch.float32,
        form=form or FORM,
        **dtypes,
    )


def incremental(x, pieces, slot=1, st=None, **kw):
    """``x`` in calls of ``pieces`` tokens from one cache slot (the rule under check; ``kw``: more of its arguments,
    e.g. a form and precision that override it)."""
    st = st or new_state(slot + 1, x[0].shape[1], x[2].shape[1])
    outs, pos = [], 0
    for n in pieces:
        r = slice(pos, pos + n)
        outs.append(rule(*(t[r] for t in x), cu([n]), chunk=C, state=st, slots=torch.tensor([slot]),
                         starts=torch.tensor([pos]), **kw))  # fmt: skip
        pos += n
    return torch.cat(outs), st


rule = gt.gated_delta_rule  # the form under check (check_rule sets it and FORM)
FORM = "scan"


def train(x):
    return rule(*x, cu([x[0].shape[0]]), chunk=C)


def count_launches(fn) -> dict[str, int]:
    """What ``fn`` would launch on a GPU: Triton kernels by name, plus any torch op that is not an allocation
    or a view (a cast or copy is a kernel launch on the device). The interpreter's own copies inside a
    launch are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    counts: dict[str, int] = {}
    inside = [False]
    free = ("aten.empty", "aten.view", "aten.slice", "aten.select", "aten.alias", "aten.detach", "aten.as_strided",
            "aten._reshape_alias", "aten.unsqueeze", "aten.expand", "aten.t.", "aten.lift_fresh")  # fmt: skip

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if not inside[0] and not name.startswith(free):
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    orig = InterpretedFunction.run

    def run(self, *args, **kwargs):
        counts[self.fn.__name__] = counts.get(self.fn.__name__, 0) + 1
        inside[0] = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            inside[0] = False

    InterpretedFunction.run = run
    try:
        with Ops():
            fn()
    finally:
        InterpretedFunction.run = orig
    return counts


@triton.jit
def _to_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n).to(tl.bfloat16), mask=o < n)


def triton_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 the way a kernel's ``.to(tl.bfloat16)`` rounds it here: the interpreter truncates (torch
    and the GPU round to nearest even), and a bf16 dot's operands are rounded the same way, so the decode dots see
    these values on either."""
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _to_bf16_kernel[(triton.cdiv(x.numel(), 256),)](x.contiguous(), y, x.numel(), BLOCK=256)
    return y


def check_entry_bf16(st) -> None:
    """A chunk-form cache's ``entry_bf16`` is ``entry`` rounded to bf16 in the slot a check used (slot 1), whichever
    kernel wrote ``entry`` last (the chain's write-back or the decode row kernel's close): the row kernel reads it."""
    assert same_bits(st.entry_bf16[1], triton_bf16(st.entry[1])), "state.entry_bf16 is not state.entry rounded"


def check_rule(form: str) -> None:
    global rule, FORM
    FORM = form
    # the chunk form's default is bf16, whose tl.dot the interpreter gets wrong: ieee here (calls may override it)
    rule = functools.partial(gt.gated_delta_rule, form=form, **({"dot_precision": "ieee"} if form == "chunk" else {}))
    # accuracy vs the CPU reference (state tolerance) on packed sequences
    xs = [inputs(n, 10 + n) for n in (13, 1, 22)]
    packed = [torch.cat([x[j] for x in xs]) for j in range(5)]
    got = rule(*packed, cu([13, 1, 22]), chunk=C)
    want = ref.gated_delta_rule(*packed, cu([13, 1, 22]), chunk=C)
    err = float((got - want).abs().max())
    assert err < 1e-5, f"vs reference {err:.2e}"
    # packing invariance
    for x, part in zip(xs, got.split([13, 1, 22]), strict=True):
        assert same_bits(train(x), part), "packing"
    # prefill(P) + decode == training forward, across chunk closes (resync) for P in 1, C-1, C, C+1, 2C+3
    for p in (1, C - 1, C, C + 1, 2 * C + 3):
        total = (p // C + 1) * C + 2
        x = inputs(total, 100 + p)
        full = train(x)
        inc, st = incremental(x, [p] + [1] * (total - p))
        assert same_bits(full, inc), f"prefill {p} + decode: max |d| {(full - inc).abs().max():.3e}"
        if form == "chunk":
            check_entry_bf16(st)
        assert float((full - ref.gated_delta_rule(*x, cu([total]), chunk=C)).abs().max()) < 1e-5
    # chunked prefill of any pieces, and the state cache against the reference's
    for pieces in ([3, 5, 9], [8, 8, 1, 7], [1, 1, 13, 2, 4], [2, 15, 6]):
        x = inputs(sum(pieces), 7)
        inc, st = incremental(x, pieces)
        assert same_bits(train(x), inc), f"pieces {pieces}"
        if form == "chunk":
            check_entry_bf16(st)
        rst = new_state(2, form="scan")  # the CPU reference's (scan) state
        pos = 0
        for n in pieces:
            r = slice(pos, pos + n)
            ref.gated_delta_rule(
                *(t[r] for t in x), cu([n]), chunk=C, state=rst, slots=torch.tensor([1]), starts=torch.tensor([pos])
            )
            pos += n
        for name in ("running", "entry") if form == "scan" else ("entry",):  # the chunk form keeps no running state
            e = float((getattr(st, name)[1] - getattr(rst, name)[1]).abs().max())
            assert e < 1e-5, f"state.{name} vs reference {e:.2e}"
        nb = sum(pieces) % C
        for name in ("buf_k", "buf_v", "buf_g", "buf_beta"):
            assert same_bits(getattr(st, name)[1, :nb], getattr(rst, name)[1, :nb]), name
    # batch composition: sequences at different positions (mid-chunk, closing, fresh, multi-chunk) in one call
    lens, prev = [5, 11, 1, 3, 19], [3, 0, 7, 8, 5]
    seqs = [inputs(p + n, 20 + i) for i, (p, n) in enumerate(zip(prev, lens, strict=True))]
    alone = [incremental(x, [p, n] if p else [n])[0][p:] for x, p, n in zip(seqs, prev, lens, strict=True)]
    st = new_state(5)
    for i, x in enumerate(seqs):
        if prev[i]:
            rule(
                *(t[: prev[i]] for t in x),
                cu([prev[i]]),
                chunk=C,
                state=st,
                slots=torch.tensor([i]),
                starts=torch.tensor([0]),
            )
    order = [2, 0, 4, 3, 1]
    cat = [torch.cat([seqs[i][j][prev[i] :] for i in order]) for j in range(5)]
    out = rule(
        *cat,
        cu([lens[i] for i in order]),
        chunk=C,
        state=st,
        slots=torch.tensor(order),
        starts=torch.tensor([prev[i] for i in order]),
    )
    for part, i in zip(out.split([lens[i] for i in order]), order, strict=True):
        assert same_bits(part, alone[i]), f"batch composition: sequence {i}"
    # heads subset (TP: key heads [0, HK/2) and their value heads) == the same heads of the full call
    x = inputs(19, 31, hk=4, hv=8)
    full = train(x)
    half = tuple(t[:, :2] if t.dim() == 3 and t.shape[1] == 4 else t[:, :4] for t in x)
    assert same_bits(train(half), full[:, :4]), "heads subset"
    inc, _ = incremental(half, [5, 1, 1, 1, 4, 1, 1, 5])
    assert same_bits(inc, full[:, :4]), "heads subset, decode"
    # inputs as the model passes them: v a bf16 view with a row stride (a column slice of the conv output), q, k, g,
    # beta fp32. Read in-kernel (bf16 -> fp32 is exact): the same bits as the fp32 copy, in training and decode.
    x = inputs(2 * C + 5, 41)
    wide = torch.cat([torch.zeros(2 * C + 5, 3), x[2].reshape(2 * C + 5, -1)], 1).bfloat16()
    v16 = wide[:, 3:].reshape(x[2].shape)
    assert not v16.is_contiguous()
    x16 = (x[0], x[1], v16, x[3], x[4])
    full = train((x[0], x[1], v16.float(), x[3], x[4]))
    assert same_bits(train(x16), full), "bf16 strided v vs its fp32 copy"
    inc, st = incremental(x16, [C - 3, 1, 1, 1, 1, 1, C - 1, 1, 1, 1, 1])
    assert same_bits(inc, full), "bf16 strided v: prefill + decode"
    nb = (2 * C + 5) % C
    assert same_bits(st.buf_v[1, :nb], v16[-nb:].float()), "buffer rows of a bf16 v"
    # a decode step (mid-chunk) launches the scan kernel only: no host-side cast/copy, the chunk-buffer write in the
    # scan (before: v's cast, _buffer_kernel, _scan_kernel). The plan is cached first, as for every layer but the first.
    step = [t[-1:].clone() for t in x16]
    step[2] = wide[-1:, 3:].reshape(1, HV, D)  # the strided bf16 view again
    c1, s1, p1 = cu([1]), torch.tensor([1]), torch.tensor([2 * C + 4])
    stc = GDNLayerState(*(t.clone() for t in vars(st).values()))
    rule(*step, c1, chunk=C, state=stc, slots=s1, starts=p1)
    counts = count_launches(lambda: rule(*step, c1, chunk=C, state=st, slots=s1, starts=p1))
    # chunk form: the decode prep (its X_bb row from the cached ones, A's and P's rows, the token into the buffer) and
    # the row kernel (Y, u and o rows)
    want = {"_scan_kernel": 1} if form == "scan" else {"_decode_prep_kernel": 1, "_decode_row_kernel": 1}
    assert counts == want, f"{form} form: decode step launches {counts}"
    print("decode step launches", counts)
    # dot-precision variants of the state pass: train == prefill + decode for each (the interpreter's dot ignores the
    # precision, so only the plumbing and the invariance logic are shown here; the GPU tests show the bits)
    x = inputs(2 * C + 5, 43)
    precs = ("ieee", "tf32x3", "tf32", "tf32x3/ieee") if form == "scan" else ("ieee", "tf32", "ieee/tf32")
    for prec in precs:
        full = rule(*x, cu([2 * C + 5]), chunk=C, dot_precision=prec)
        st, outs, pos = new_state(2), [], 0
        for n in [C + 1, 1, 1, C - 3, 1, 1, 1, 1, 1]:
            r = slice(pos, pos + n)
            outs.append(rule(*(t[r] for t in x), cu([n]), chunk=C, state=st, slots=torch.tensor([1]),
                                            starts=torch.tensor([pos]), dot_precision=prec))  # fmt: skip
            pos += n
        assert same_bits(torch.cat(outs), full), f"dot_precision={prec}: train vs prefill + decode"
    for bad in ("fp32", "bf16x3", "IEEE", "ieee/", "ieee/tf32x3/tf32", "ieee/fp32"):
        try:
            rule(*x, cu([2 * C + 5]), chunk=C, dot_precision=bad)
            raise AssertionError(f"dot_precision={bad!r} accepted")
        except ValueError as e:
            assert "dot_precision" in str(e) and "'tf32x3'" in str(e), str(e)
    for bad in ("tf32x3", "ieee/tf32x3", "tf32x3/bf16"):  # the chunk form refuses tf32x3 (its row bits follow M)
        try:
            gc.config_for(D, D, C, bad, "chunk")
            raise AssertionError(f"chunk form accepted {bad!r}")
        except ValueError as e:
            assert "form='chunk'" in str(e) and "'bf16'" in str(e), str(e)
    assert gc.config_for(D, D, C, "ieee/bf16", "chunk").form == "chunk"
    cfg = gc.config_for(D, D, C)
    assert cfg.dot_precision == gc.DOT_PRECISION == "ieee/tf32x3"
    assert gt._RULE_CONSTANTS["dot_precision_defaults"] == ["scan:ieee/tf32x3", "chunk:bf16"]
    assert (cfg.prep_precision, cfg.chain_precision) == ("ieee", "tf32x3") == gc.split_dot_precision(gc.DOT_PRECISION)
    assert gc.split_dot_precision("tf32") == ("tf32", "tf32") and gc.config_for(D, D, C, "tf32").dot_precision == "tf32"
    # chunk 16: four blocks of the prep kernel's triangular inverse (INV_BLOCK 4 here), so block rows 1..3 each sum
    # over 1..3 lower blocks (chunk C has two). Against the reference, and train == prefill + decode across closes.
    C16 = 4 * gc.INV_BLOCK
    assert gc.config_for(D, D, C16).inv_block == gc.INV_BLOCK
    x = inputs(2 * C16 + 3, 47)
    st16 = GDNLayerState.allocate(2, conv_dim=4, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D, value_dim=D,
                                  chunk=C16, dtype=torch.float32, form=form)  # fmt: skip
    full = rule(*x, cu([2 * C16 + 3]), chunk=C16)
    err = float((full - ref.gated_delta_rule(*x, cu([2 * C16 + 3]), chunk=C16)).abs().max())
    assert err < 1e-5, f"chunk {C16} vs reference {err:.2e}"
    outs, pos = [], 0
    for n in [C16 - 1, 1, 1, C16 + 2, 1, 1]:
        r = slice(pos, pos + n)
        outs.append(rule(*(t[r] for t in x), cu([n]), chunk=C16, state=st16, slots=torch.tensor([1]),
                                        starts=torch.tensor([pos])))  # fmt: skip
        pos += n
    assert same_bits(torch.cat(outs), full), f"chunk {C16}: train vs prefill + decode"
    print(f"rule ok ({form} form)", round(time.time() - t_start, 1))


def check_bf16_storage() -> None:
    # bf16 storage of the dot-only intermediates (gc.MID_BF16: W, KD, u, entry states; chunk form, bf16 chain dots) is
    # bit-neutral: training, prefill + decode and the state cache as with fp32 storage. The interpreter's bf16 dot gives
    # wrong values, but a fixed function of the bf16 operands, which is all this plumbing check needs (the GPU test
    # test_bf16_storage_of_intermediates_is_bit_neutral holds the same on tensor cores).
    x = inputs(2 * C + 5, 44)
    got = {}
    for mid in (True, False):
        gc.MID_BF16 = mid
        kw = {"form": "chunk", "dot_precision": "bf16"}
        inc, st = incremental(x, [C + 1, 1, 1, C - 3, 1, 1, 1, 1, 1], st=new_state(2, form="chunk"), **kw)
        check_entry_bf16(st)
        # buf_u rows a prefill copied hold the stored u (bf16 values under MID_BF16): equal as the dots see them
        got[mid] = (
            gt.gated_delta_rule(*x, cu([2 * C + 5]), chunk=C, **kw),
            inc,
            st.entry[1],
            st.buf_u[1].bfloat16(),
        )
    gc.MID_BF16 = True
    assert gc.config_for(D, D, C, "bf16", "chunk").mid_dtype == torch.bfloat16
    assert gc.config_for(D, D, C, "tf32", "chunk").mid_dtype == torch.float32
    for name, a, b in zip(("train", "prefill + decode", "state.entry", "state.buf_u"), *got.values(), strict=True):
        assert same_bits(a, b), f"bf16 storage: {name}"
    assert same_bits(got[True][0], got[True][1]), "bf16 storage: train vs prefill + decode"
    # The state cache's narrow buffers (buf_v in bf16 v's dtype, buf_u in the bf16 u is stored in) give the bits of
    # fp32 ones: in a prefill's buffer copy and in the decode steps' reads and writes.
    x16 = (*x[:2], x[2].bfloat16(), *x[3:])
    narrow = {"v_dtype": torch.bfloat16, "u_dtype": gc.chunk_u_dtype("bf16")}
    assert narrow["u_dtype"] == torch.bfloat16
    got = {}
    for dtypes in ({}, narrow):
        inc, st = incremental(x16, [C + 1, 1, 1, C - 3, 1, 1, 1, 1, 1], st=new_state(2, form="chunk", **dtypes), **kw)
        # buf_u compared as the dots read it: rounded the kernels' way (triton_bf16), the fp32 buffer's decode rows too
        got[bool(dtypes)] = (
            inc,
            st.entry[1],
            triton_bf16(st.buf_u[1].float()),
            triton_bf16(st.buf_y[1].float()),
            st.buf_v[1, :5].float(),
        )
    for name, a, b in zip(
        ("prefill + decode", "state.entry", "state.buf_u", "state.buf_y", "state.buf_v"), *got.values(), strict=True
    ):
        assert same_bits(a, b), f"narrow state buffers: {name}"
    print("bf16 storage ok", round(time.time() - t_start, 1))


def check_conv() -> None:
    # conv: prefill + decode == training, batch composition, against fp64

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        xc, w = torch.randn(14, 12, generator=gen).to(dtype), torch.randn(12, 4, generator=gen).to(dtype)
        full = cg.causal_conv1d(xc, w, cu([14]))
        cs = torch.full((2, 12, 3), float("nan"), dtype=dtype)
        outs, pos = [], 0
        for n in (2, 5, 1, 1, 1, 4):
            outs.append(
                cg.causal_conv1d(
                    xc[pos : pos + n], w, cu([n]), conv_state=cs, slots=torch.tensor([1]), starts=torch.tensor([pos])
                )
            )
            pos += n
        assert same_bits(full, torch.cat(outs)), "conv prefill/decode"
        assert same_bits(cs[1], xc[-3:].t()), "conv state"
        two = cg.causal_conv1d(torch.cat([xc[:5], xc]), w, cu([5, 14]))
        assert same_bits(two[5:], full) and same_bits(two[:5], full[:5]), "conv packing"
        r64 = torch.nn.functional.silu(
            torch.nn.functional.conv1d(xc.double().t()[None], w.double()[:, None], padding=3, groups=12)[0, :, :14].t()
        )
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((full.double() - r64).abs().max()) < tol, "conv accuracy"
        rc = ref.causal_conv1d(xc, w, cu([14]))
        assert float((full.double() - rc.double()).abs().max()) < tol
    # a sequence shorter than K-1 keeps the older history in its conv state
    cs = torch.zeros(1, 12, 3)
    xc = torch.randn(6, 12, generator=gen)
    cg.causal_conv1d(
        xc[:4], torch.ones(12, 4), cu([4]), conv_state=cs, slots=torch.tensor([0]), starts=torch.tensor([0])
    )
    cg.causal_conv1d(
        xc[4:5], torch.ones(12, 4), cu([1]), conv_state=cs, slots=torch.tensor([0]), starts=torch.tensor([4])
    )
    assert same_bits(cs[0], xc[2:5].t()), "conv state of a short call"
    # read in place: x a column slice of a wider projection row (the model's qkv), empty sequences in the pack (the
    # kernel finds each row's sequence by bisection over cu_seqlens)
    wide = torch.randn(14, 20, generator=gen)
    xs, wt = wide[:, 3:15], torch.randn(12, 4, generator=gen)
    assert xs.stride(0) == 20 and not xs.is_contiguous()
    assert same_bits(cg.causal_conv1d(xs, wt, cu([6, 8])), cg.causal_conv1d(xs.contiguous(), wt, cu([6, 8]))), "strided"
    gaps = torch.tensor([0, 0, 6, 6, 6, 14, 14], dtype=torch.int32)  # sequences of 0, 6, 0, 0, 8, 0 rows
    assert same_bits(cg.causal_conv1d(xs, wt, gaps), cg.causal_conv1d(xs, wt, cu([6, 8]))), "empty sequences"
    cs_a, cs_b = torch.zeros(3, 12, 3), torch.zeros(3, 12, 3)
    kw = {"slots": torch.tensor([2, 0]), "starts": torch.tensor([0, 0])}
    ya = cg.causal_conv1d(xs[:5], wt, cu([2, 3]), conv_state=cs_a, **kw)
    yb = cg.causal_conv1d(xs[:5].contiguous(), wt, cu([2, 3]), conv_state=cs_b, **kw)
    assert same_bits(ya, yb) and same_bits(cs_a, cs_b), "strided with a conv state"
    # a decode step (one row per sequence: the conv shifts the state in its own launch), warm and fresh sequences,
    # against the reference's outputs and states
    for dtype in (torch.float32, torch.bfloat16):
        hist = torch.randn(4, 12, 3, generator=gen).to(dtype)
        cs_t, cs_r = hist.clone(), hist.clone()
        xd = wide[:3, 3:15].to(dtype)
        kw = {"slots": torch.tensor([3, 0, 1]), "starts": torch.tensor([7, 0, 2])}
        yt = cg.causal_conv1d(xd, wt.to(dtype), cu([1, 1, 1]), conv_state=cs_t, **kw)
        yr = ref.causal_conv1d(xd, wt.to(dtype), cu([1, 1, 1]), conv_state=cs_r, **kw)
        # one rounding to the output dtype apart (the interpreter truncates fp32 -> bf16 where the GPU rounds)
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        assert bool(((yt.double() - yr.double()).abs() <= yr.double().abs() * tol + 1e-6).all()), f"decode ({dtype})"
        assert same_bits(cs_t, cs_r), f"decode step's conv state ({dtype})"
        assert same_bits(cs_t[2], hist[2]), "a slot no sequence holds is untouched"
    print("conv ok")


def check_gates() -> None:
    # gates and l2norm: batch invariant, accurate
    gen = torch.Generator().manual_seed(5)
    a, b, xn = torch.randn(33, HV, generator=gen) * 8, torch.randn(33, HV, generator=gen), torch.randn(33, 3, 24)
    al, dt = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    g, beta = cg.gdn_gates(a, b, al, dt)
    nrm = cg.l2norm(xn)
    for i in (0, 17, 32):
        gi, bi = cg.gdn_gates(a[i : i + 1], b[i : i + 1], al, dt)
        assert same_bits(gi[0], g[i]) and same_bits(bi[0], beta[i]) and same_bits(cg.l2norm(xn[i : i + 1])[0], nrm[i])
    rg, rb = ref.gdn_gates(a, b, al, dt)
    assert float(((g - rg).abs() / rg.abs()).max()) < 1e-6 and float((beta - rb).abs().max()) < 1e-6
    assert float((nrm - ref.l2norm(xn)).abs().max()) < 1e-6
    # read in place: a, b and the l2norm input as column slices of one wider row (the model's projection)
    wide = torch.randn(33, 2 * HV + 77, generator=gen)
    sa, sb = wide[:, 5 : 5 + HV], wide[:, 40 : 40 + HV]
    gs, bs = cg.gdn_gates(sa, sb, al, dt)
    gc, bc = cg.gdn_gates(sa.contiguous(), sb.contiguous(), al, dt)
    assert same_bits(gs, gc) and same_bits(bs, bc), "gates of strided a, b"
    heads = wide[:, 2 : 2 + 72].reshape(33, 3, 24)
    assert heads.stride() == (wide.shape[1], 24, 1)
    assert same_bits(cg.l2norm(heads), cg.l2norm(heads.contiguous())), "l2norm of a strided [T, H, D] view"
    print("gates ok", round(time.time() - t_start, 1))


def check_grads() -> None:
    # backward (ops/gdn/triton/backward.py's kernels): deterministic, close to fp64 autograd of the reference, per form
    # (the scan form recomputes the chunk-form state pass), with an open last chunk and Dk != Dv
    gen = torch.Generator().manual_seed(7)
    for form, prec, dv in (("scan", None, D), ("chunk", "ieee", D), ("chunk", "ieee", 12)):
        lengths = [13, 8, 3]
        x = random_gdn_inputs(24, 9, hk=HK, hv=HV, dk=D, dv=dv)
        w8 = torch.randn(24, HV, dv, generator=gen)
        kw = {"chunk": C, "form": form, "dot_precision": prec}
        grads = checked_rule_grads(gt.gated_delta_rule, x, cu(lengths), w8, **kw)
        lr = [t.double().requires_grad_(True) for t in x]
        (ref.gated_delta_rule(*lr, cu(lengths), chunk=C) * w8.double()).sum().backward()
        for name, p, r in zip("qkvgb", grads, lr, strict=True):
            e = float((p.double() - r.grad).abs().max() / r.grad.abs().max())
            assert e < 1e-5, f"{form} Dv {dv} grad {name}: {e:.2e}"
    xc = torch.randn(9, 12, generator=gen, requires_grad=True)
    wc = torch.randn(12, 4, generator=gen, requires_grad=True)
    xr, wr = xc.detach().clone().requires_grad_(True), wc.detach().clone().requires_grad_(True)
    (cg.causal_conv1d(xc, wc, cu([4, 5])) * torch.arange(108.0).reshape(9, 12)).sum().backward()
    (ref.causal_conv1d(xr, wr, cu([4, 5])) * torch.arange(108.0).reshape(9, 12)).sum().backward()
    assert float((xc.grad - xr.grad).abs().max()) < 1e-3 and float((wc.grad - wr.grad).abs().max()) < 1e-3, "conv grads"
    print("grad ok", round(time.time() - t_start, 1))


PARTS = {
    "scan": functools.partial(check_rule, "scan"),
    "chunk": functools.partial(check_rule, "chunk"),
    "bf16_storage": check_bf16_storage,
    "conv": check_conv,
    "gates": check_gates,
    "grads": check_grads,
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; allowed: {list(PARTS)}")
    for name in names:
        PARTS[name]()
    print("parts ok:", " ".join(names))
