"""Gated DeltaNet on one GPU: ours (ops.gdn, cuda/correctness = CPR Triton kernels) vs FLA, per layer.

Shapes: one Qwen3-Next GDN layer (conf/model/qwen3_next_80b_a3b.yaml: Hk=16, Hv=32, Dk=Dv=128; CPR chunk 64).
What is timed is the gated delta rule of one layer (the part FLA's two entry points cover), not the layer's
projections, conv and norms around it: those are GEMMs and elementwise ops outside this comparison, so ratios
here are the rule's, the hardest part of the layer-level target.

Timings (median ms, ``triton.testing.do_bench``; Python wrapper time included, no CUDA graphs):
- ``train``: packed batch x T tokens. ``ours_fwd_ms`` / ``fla_fwd_ms``: the training forward (inputs that
  require grad, as in a training step; ours: the invariant forward; FLA: ``chunk_gated_delta_rule``, bf16
  q/k/v). ``ours_fwd_bwd_ms``: forward + backward (ours: the Triton chunk backward, ops/gdn/triton/backward.py).
  ``fla_fwd_bwd_ms``: FLA's forward + backward, or ``fla_fwd_bwd`` = ``"unavailable: <reason>"`` where FLA
  refuses it (fla-core 0.6.0 refuses its gated ``chunk_bwd_dqkwg`` on Hopper with Triton >= 3.4, < 3.7.1).
  With ``--fla-bwd-unchecked`` the refusal is lifted in that case's process and ``fla_fwd_bwd_unchecked_ms`` is
  FLA's fwd+bwd time there: a speed anchor only (its db/dg are the miscompiled ones of fla #640).
- ``prefill``: one sequence of T tokens from a fresh state, forward only, final state kept (ours: into the
  GDN state cache; FLA: ``chunk_gated_delta_rule(output_final_state=True)``).
- ``decode``: one token for each of B sequences, each mid-chunk, from its cached state (ours: the scan kernel
  from the running state; FLA: ``fused_recurrent_gated_delta_rule`` with ``initial_state`` [B, Hv, Dk, Dv]
  fp32). Ours is timed with its per-call plan cached, as in a model forward where every GDN layer reuses
  the plan of the first. ``ours_kernel_ms`` / ``fla_kernel_ms`` (and ``ours_over_fla_kernels``): the device time
  of each side's kernels alone (torch.profiler), since a decode step is short enough for the Python wrapper to
  show in the ``do_bench`` figure (H200, batch 64: FLA's 0.093 ms kernel read 0.097-0.111 ms there).

Mismatch (``mismatch`` in the JSON), on one sequence of ``--mm-prompt`` prompt + ``--mm-decode`` decoded
tokens, random inputs shaped like the model's (q, k l2-normalised; v ~ N(0, 1); g = -exp(A_log) *
softplus(a + 1) with A_log = log U(1, 16), a ~ N(0, 1); beta = sigmoid(N(0, 1))), all value heads, outputs o
of the rule (before the gated norm):
- ``fla_train_vs_rollout``: FLA's training forward (``chunk_gated_delta_rule`` over the whole sequence) vs
  FLA's rollout (chunk prefill of the prompt, then ``fused_recurrent_gated_delta_rule`` one token at a time from
  the carried state), on the decoded tokens' outputs: max |d| and mean |d| over tokens x heads x Dv, in the
  inputs' dtype (bf16 q/k/v, as FLA is used in training and serving), plus mean |o| for scale. This is the
  trainer-vs-rollout gap of a stock stack at the rule.
- ``fla_chunk_vs_recurrent``: FLA chunk vs FLA fused recurrent over the whole sequence (every token).
- ``ours_train_vs_rollout``: ours, training forward vs prefill + token-by-token decode: max |d| (must be 0)
  and whether all bits are equal.
- ``*_vs_fp64``: each output vs an fp64 recurrence on the same (bf16-rounded) inputs: max / mean |d|.

Every case runs in its own subprocess (this script with ``--case``) under ``--case-timeout`` seconds, so a
crash (a CUDA illegal access poisons the whole context) or a hang costs that one case only; each row is
printed when it completes and the JSON is rewritten after every row (a failed case is under ``errors``).

Usage: ``python3 tools/bench_gdn.py --out $OUT/bench_gdn.json`` (``--quick`` for a short run). FLA is used
when ``import fla`` works (wheel fla-core + einops); otherwise its rows say why they are missing.

Dot-precision variants of the state pass (``triton.config.DOT_PRECISIONS``, or ``PREP/CHAIN`` such as
``ieee/tf32x3``; docs/GDN.md, "GPU speed"): ``--dot-precision ieee tf32x3 ieee/tf32x3`` runs, per variant, the
training forward, the first ``--prefill`` length, decode at every ``--decode`` batch and the mismatch case (our rule
called with ``dot_precision=P``), then prints one summary line per variant: forward ms, ours vs fp64 (max / mean
|d|), train vs rollout (max |d|, bitwise). Exit status 1 if a variant's train vs rollout is not bitwise. A case
spec may also name one directly: ``--profile train:8x4096@tf32x3``.

CPU dry run of the same case logic (no timings worth reading): ``--device cpu`` runs our Triton kernels and
FLA's fused recurrent kernel under ``TRITON_INTERPRET=1`` (set for the child processes) at the shapes given by
``--shape``; FLA's chunk kernels do not run under the interpreter, so there a stand-in with the chunk
function's call contract (built on FLA's fused recurrent kernel) takes their place.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

# Overridden by --shape (the CPU dry run uses tiny heads).
HK, HV, D, CHUNK = 16, 32, 128, 64
DEVICE = "cuda"
# The state pass's dot precision of this case (a case spec's "@P" suffix); None: the dispatching op (registered
# default).
DOT_PRECISION: str | None = None
FORM: str | None = None  # triton.config.FORMS; set with the precision by a variant "FORM:P"
VARIANT: str | None = None  # the case's "@..." suffix as given
RESULT_TAG = "BENCH_GDN_CASE_RESULT "


def _set_shape(spec: str) -> None:
    global HK, HV, D, CHUNK
    try:
        HK, HV, D, CHUNK = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--shape {spec!r}: expected Hk,Hv,D,chunk (four integers)") from None
    if HV % HK:
        raise SystemExit(f"--shape {spec!r}: Hv={HV} must be a multiple of Hk={HK}")


def _interpreter_setup() -> None:
    """Under TRITON_INTERPRET=1 (CPU dry run): triton 3.6's interpreter cannot loop to a run-time bound
    with numpy 2.x (``int()`` of a 1-element array), and autotuners would time configs on a GPU driver
    that is not there; patch the one conversion and make every config time the same."""
    import triton.runtime.autotuner as autotuner

    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()
    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles=None: [1.0, 1.0, 1.0])


def _rule():
    """Our gated delta rule: the dispatching op on CUDA; on CPU the Triton package's own (interpreter); the
    Triton package's with ``dot_precision`` (and ``form``) when the case names a variant (``@P``, ``@FORM:P``)."""
    if VARIANT is not None:
        import functools

        from megatron_iso.ops.gdn.triton.rule import gated_delta_rule as triton_rule

        return functools.partial(triton_rule, dot_precision=DOT_PRECISION, form=FORM)
    if DEVICE == "cuda":
        from megatron_iso.ops.gdn import gated_delta_rule
    else:
        from megatron_iso.ops.gdn.triton.rule import gated_delta_rule
    return gated_delta_rule


def parse_variant(variant: str) -> tuple[str | None, str]:
    """``P`` or ``FORM:P`` -> (form or None, P), both checked against triton.config's lists (ValueError)."""
    from megatron_iso.ops.gdn.triton.config import FORMS, split_dot_precision

    form, colon, prec = variant.rpartition(":")
    if colon and form not in FORMS:
        raise ValueError(f"variant {variant!r}: form {form!r} must be one of {list(FORMS)}")
    split_dot_precision(prec)
    return (form or None), prec


def _split_variant(spec: str) -> str:
    """``kind:size@VARIANT`` -> ``kind:size``, setting DOT_PRECISION, FORM and VARIANT from it."""
    global DOT_PRECISION, FORM, VARIANT
    spec, at, variant = spec.partition("@")
    if at:
        try:
            FORM, DOT_PRECISION = parse_variant(variant)
        except ValueError as e:
            raise SystemExit(f"case {spec}@{variant}: {e}") from None
        VARIANT = variant
    return spec


def _inputs(b: int, t: int, seed: int):
    """q, k (l2-normalised fp32), v (fp32), g, beta (fp32), shaped [b, t, H, D] / [b, t, H]."""
    from megatron_iso.ops.gdn import native

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = native.l2norm(torch.randn(b, t, HK, D, device=DEVICE, generator=gen))
    k = native.l2norm(torch.randn(b, t, HK, D, device=DEVICE, generator=gen))
    v = torch.randn(b, t, HV, D, device=DEVICE, generator=gen)
    a = torch.randn(b, t, HV, device=DEVICE, generator=gen)
    a_log = torch.empty(HV, device=DEVICE).uniform_(1, 16, generator=gen).log()
    g = -a_log.exp() * torch.nn.functional.softplus(a + 1.0)
    beta = torch.sigmoid(torch.randn(b, t, HV, device=DEVICE, generator=gen))
    return q, k, v, g, beta


def _bench(fn, quick: bool) -> float:
    if DEVICE != "cuda":  # dry run: one call after the warm-up call, wall time
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench  # warmup and rep are in ms of GPU time

    return float(do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median"))


def _fla():
    """(chunk, fused_recurrent, error): FLA's two entry points, or why they are missing."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # report why, keep our rows
        return None, None, traceback.format_exc(limit=3)
    if DEVICE == "cuda":
        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, None

    def chunk_standin(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        # Same call contract as chunk_gated_delta_rule (positional q, k, v, g, beta; [B, T, H, D]).
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state)  # fmt: skip

    return chunk_standin, fused_recurrent_gated_delta_rule, None


def _fla_version() -> str | None:
    try:
        import fla

        return fla.__version__
    except Exception:
        return None


def _fla_bwd_unavailable(exc: BaseException) -> str | None:
    """The reason string when ``exc`` is FLA refusing a backward it cannot run correctly here; else None.

    fla-core 0.6.0 raises RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect
    results for gated chunk_bwd_dqkwg (see #640) ...") before launching anything; its fused recurrent
    kernel (the CPU dry run's stand-in) has no backward at all (NotImplementedError)."""
    msg = str(exc)
    known = isinstance(exc, RuntimeError) and ("chunk_bwd_dqkwg" in msg or "upgrade Triton" in msg)
    if known or (isinstance(exc, NotImplementedError) and "Backward" in msg):
        return "unavailable: " + msg.strip().splitlines()[0]
    return None


def _fla_bwd_refused() -> str | None:
    """Why FLA will refuse its chunk backward here, read from the flags its own check uses (fla-core 0.6.0,
    ``fla.ops.common.chunk_o.chunk_bwd_dqkwg``), so the bench does not compile and run the backward's first
    kernels only to hit that refusal. None when the flags allow it (or tilelang, FLA's other backend for
    that function, is installed): then the backward is attempted and a refusal is still caught."""
    import importlib.util

    try:
        from fla.ops.common import chunk_o
    except Exception:
        return None
    hopper = getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
    bad_triton = getattr(chunk_o, "TRITON_ABOVE_3_4_0", False) and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    if DEVICE == "cuda" and hopper and bad_triton and importlib.util.find_spec("tilelang") is None:
        return (
            "unavailable: fla-core refuses gated chunk_bwd_dqkwg on Hopper with 3.4.0 <= Triton < 3.7.1 "
            "(fla issue #640) and tilelang is not installed; not attempted"
        )
    return None


def _state(slots: int):
    """A state cache as the model allocates one: buf_v in v's dtype (bf16, as the model's), buf_u as the chunk form
    stores u."""
    from megatron_iso.ops.gdn import GDNLayerState
    from megatron_iso.ops.gdn.triton.config import state_u_dtype

    form = FORM or "scan"
    u_dtype = state_u_dtype(form, DOT_PRECISION)
    return GDNLayerState.allocate(slots, conv_dim=4, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D,
                                  value_dim=D, chunk=CHUNK, dtype=torch.bfloat16, device=DEVICE, form=form,
                                  v_dtype=torch.bfloat16, u_dtype=u_dtype)  # fmt: skip


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _train_ours(b: int, t: int):
    """(ours_fwd, inputs): our training forward on a packed b x t batch (inputs that require grad)."""
    rule = _rule()
    q, k, v, g, beta = _inputs(b, t, 1)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    flat[2] = flat[2].bfloat16()  # the model's v is in the model dtype; q, k come from l2norm in fp32
    cu = _cu([t] * b)

    def ours_fwd():
        return rule(*[x.detach().requires_grad_(True) for x in flat], cu, chunk=CHUNK)

    return ours_fwd, (q, k, v, g, beta)


def bench_train(b: int, t: int, quick: bool, fla_bwd_unchecked: bool = False) -> dict:
    """``fla_bwd_unchecked``: time FLA's fwd+bwd where fla-core refuses its gated backward (speed only)."""
    fla_chunk, _, fla_err = _fla()
    ours_fwd, (q, k, v, g, beta) = _train_ours(b, t)
    dout = torch.randn(b * t, HV, D, device=DEVICE)
    row: dict = {"case": "train", "batch": b, "T": t}
    row["ours_fwd_ms"] = _bench(ours_fwd, quick)
    row["ours_fwd_bwd_ms"] = _bench(lambda: ours_fwd().backward(dout), quick)
    if fla_chunk is None:
        row["fla"] = "unavailable: " + (fla_err or "").strip().splitlines()[-1]
        return row
    fq, fk, fv = (x.bfloat16() for x in (q, k, v))
    fdo = dout.reshape(b, t, HV, D).bfloat16()

    def fla_fwd():
        return fla_chunk(*[x.detach().requires_grad_(True) for x in (fq, fk, fv, g, beta)], scale=D**-0.5)[0]

    row["fla_fwd_ms"] = _bench(fla_fwd, quick)
    row["ours_over_fla_fwd"] = row["ours_fwd_ms"] / row["fla_fwd_ms"]
    refused = _fla_bwd_refused()
    if refused is not None and fla_bwd_unchecked:
        from fla.ops.common import chunk_o

        # Lift fla-core's own refusal for this process: its gated backward then runs, with the db/dg that fla
        # #640 says are wrong on this Triton. Only its time is kept, as the fwd+bwd anchor (never its gradients).
        chunk_o.TRITON_ABOVE_3_7_1 = True
        row["fla_fwd_bwd_unchecked_ms"] = _bench(lambda: fla_fwd().backward(fdo), quick)
        row["ours_over_fla_fwd_bwd_unchecked"] = row["ours_fwd_bwd_ms"] / row["fla_fwd_bwd_unchecked_ms"]
    if refused is not None:
        row["fla_fwd_bwd"] = refused
        return row
    try:
        fla_fwd().backward(fdo)  # once outside the timer: FLA may refuse its backward on this GPU/Triton
    except (RuntimeError, NotImplementedError) as exc:
        reason = _fla_bwd_unavailable(exc)
        if reason is None:
            raise
        row["fla_fwd_bwd"] = reason
        return row
    row["fla_fwd_bwd_ms"] = _bench(lambda: fla_fwd().backward(fdo), quick)
    row["ours_over_fla_fwd_bwd"] = row["ours_fwd_bwd_ms"] / row["fla_fwd_bwd_ms"]
    return row


def _prefill_ours(t: int):
    """(ours, inputs): our prefill of one t-token sequence from a fresh state (call under no_grad)."""
    rule = _rule()
    q, k, v, g, beta = (x[0] for x in _inputs(1, t, 2))
    st = _state(1)
    cu, slots, starts = _cu([t]), torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE)
    vb = v.bfloat16()
    return (lambda: rule(q, k, vb, g, beta, cu, chunk=CHUNK, state=st, slots=slots, starts=starts)), (q, k, v, g, beta)


def bench_prefill(t: int, quick: bool) -> dict:
    fla_chunk, _, _ = _fla()
    ours, (q, k, v, g, beta) = _prefill_ours(t)
    row: dict = {"case": "prefill", "T": t}
    with torch.no_grad():
        row["ours_ms"] = _bench(ours, quick)
        if fla_chunk is not None:
            args = [x[None].bfloat16() for x in (q, k, v)] + [g[None], beta[None]]  # [1, T, H(, D)]
            row["fla_ms"] = _bench(lambda: fla_chunk(*args, scale=D**-0.5, output_final_state=True), quick)
            row["ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
    return row


def decode_starts(n: int, closing: bool = False) -> torch.Tensor:
    """Positions of n decoding sequences, all mid-chunk (1 .. C-2 tokens buffered, past two chunks), so
    one more token never closes a chunk; ``closing``: all at a chunk's last position (C - 1 buffered), so the step
    closes every sequence's chunk (the chain's exit state, once in C steps of a sequence)."""
    if closing:
        return torch.full((n,), 3 * CHUNK - 1, device=DEVICE)
    return 2 * CHUNK + 1 + torch.arange(n, device=DEVICE) % max(CHUNK - 2, 1)


def _decode_ours(n: int, closing: bool = False):
    """(ours, inputs): one decode step of n sequences from their cached states (under no_grad), mid-chunk or, with
    ``closing``, each closing its chunk."""
    rule = _rule()
    q, k, v, g, beta = (x[:, 0] for x in _inputs(n, 1, 3))  # [n, H(, D)]: one token per sequence
    st = _state(n)
    st.running.normal_()
    cu = _cu([1] * n)
    slots = torch.arange(n, device=DEVICE)  # one slot per sequence, all inside the n-slot cache
    starts = decode_starts(n, closing)
    assert int(slots.max()) < st.running.shape[0] and bool((((starts % CHUNK) + 1 == CHUNK) == closing).all())
    vb = v.bfloat16()
    return (lambda: rule(q, k, vb, g, beta, cu, chunk=CHUNK, state=st, slots=slots, starts=starts)), (q, k, v, g, beta)


def _decode_fla(fla_rec, inputs: tuple[torch.Tensor, ...]):
    """FLA's decode step (fused recurrent, one token per sequence from its state) on ``_decode_ours``'s inputs.

    FLA 0.6.0: fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...): the 5th positional is gk (per-key
    decay [B, T, Hv, Dk]), so beta goes by keyword. q, k [B, 1, Hk, D]; v [B, 1, Hv, D]; g, beta [B, 1, Hv];
    initial_state [B, Hv, Dk, Dv] fp32 (the K-first layout, state_v_first=False)."""
    q, k, v, g, beta = inputs
    fq, fk, fv = (x[:, None].bfloat16().contiguous() for x in (q, k, v))
    fg, fb = g[:, None].contiguous(), beta[:, None].contiguous()
    h0 = torch.randn(q.shape[0], HV, D, D, device=DEVICE)
    return lambda: fla_rec(fq, fk, fv, fg, beta=fb, scale=D**-0.5, initial_state=h0, output_final_state=True)


def _profiled_calls(fn, iters: int, warm: int = 2) -> tuple[torch.profiler.profile, float, float]:
    """``iters`` calls of ``fn`` under torch.profiler (CUDA activity on the GPU), after ``warm`` unprofiled ones:
    the profile, the host seconds spent inside the calls, and the wall seconds of all of them with a final sync."""
    cuda = DEVICE == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warm):
        fn()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    host = 0.0
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            t1 = time.perf_counter()
            fn()
            host += time.perf_counter() - t1
        sync()
        wall = time.perf_counter() - t0
    return prof, host, wall


def _kernel_ms(fn, iters: int = 5) -> float | None:
    """Device time of ``fn``'s kernels per call: the kernels alone, without the Python wrapper that ``do_bench``'s
    figure includes wherever the host is slower than the device; the time they cover, so kernels that overlap (a
    programmatic dependent launch) count once. None off the GPU."""
    if DEVICE != "cuda":
        return None
    from megatron_iso.bench.profiling import kernel_events, kernel_span_ms

    prof, _, _ = _profiled_calls(fn, iters, warm=1)
    return kernel_span_ms(kernel_events(prof)) / iters


def bench_decode(n: int, quick: bool) -> dict:
    _, fla_rec, _ = _fla()
    ours, inputs = _decode_ours(n)
    row: dict = {"case": "decode", "batch": n}
    with torch.no_grad():
        row["ours_ms"] = _bench(ours, quick)
        row["ours_kernel_ms"] = _kernel_ms(ours)
        if fla_rec is not None:
            fla = _decode_fla(fla_rec, inputs)
            row["fla_ms"] = _bench(fla, quick)
            row["fla_kernel_ms"] = _kernel_ms(fla)
            row["ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
            if row["ours_kernel_ms"] and row["fla_kernel_ms"]:
                row["ours_over_fla_kernels"] = row["ours_kernel_ms"] / row["fla_kernel_ms"]
    return row


def _naive64(q, k, v, g, beta):
    """fp64 recurrence: q, k [T, HK, D]; v [T, HV, D]; g, beta [T, HV] -> [T, HV, D]."""
    rep = HV // HK
    q, k = (x.double().repeat_interleave(rep, 1) for x in (q, k))  # value head h reads key head h // rep
    q = q * D**-0.5
    v, g, beta = v.double(), g.double(), beta.double()
    s = torch.zeros(HV, D, D, dtype=torch.float64, device=q.device)
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.double() - b.double()).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}


def mismatch(prompt: int, decode: int) -> dict:
    rule = _rule()
    fla_chunk, fla_rec, _ = _fla()
    t = prompt + decode
    q, k, v, g, beta = (x[0] for x in _inputs(1, t, 4))
    q, k, v = (x.bfloat16() for x in (q, k, v))  # the same rounded inputs for every path
    res: dict = {"case": "mismatch", "prompt": prompt, "decode": decode}
    with torch.no_grad():
        ref = _naive64(q, k, v, g, beta)
        res["mean_abs_o_fp64"] = float(ref.abs().mean())
        full = rule(q, k, v, g, beta, _cu([t]), chunk=CHUNK)
        st = _state(1)
        outs, pos = [], 0
        for n in [prompt] + [1] * decode:
            r = slice(pos, pos + n)
            outs.append(rule(q[r], k[r], v[r], g[r], beta[r], _cu([n]), chunk=CHUNK, state=st,
                             slots=torch.tensor([0], device=DEVICE),
                             starts=torch.tensor([pos], device=DEVICE)))  # fmt: skip
            pos += n
        inc = torch.cat(outs)
        res["ours_train_vs_rollout"] = {
            **_diff(full, inc),
            "bitwise_equal": bool(torch.equal(full.view(torch.int32), inc.view(torch.int32))),
        }
        res["ours_vs_fp64"] = _diff(full, ref)
        if fla_chunk is not None:
            q5, k5, v5, g5, b5 = (x[None].contiguous() for x in (q, k, v, g, beta))  # [1, T, H(, D)]

            def rec(sl: slice, h0=None):
                return fla_rec(q5[:, sl], k5[:, sl], v5[:, sl], g5[:, sl], beta=b5[:, sl], scale=D**-0.5,
                               initial_state=h0, output_final_state=h0 is not None)  # fmt: skip

            f_full, _ = fla_chunk(q5, k5, v5, g5, b5, scale=D**-0.5)
            f_rec_all, _ = rec(slice(0, t))
            _, h = fla_chunk(q5[:, :prompt], k5[:, :prompt], v5[:, :prompt], g5[:, :prompt], b5[:, :prompt],
                             scale=D**-0.5, output_final_state=True)  # fmt: skip
            dec = []
            for i in range(prompt, t):
                o, h = rec(slice(i, i + 1), h)
                dec.append(o)
            f_dec = torch.cat(dec, 1)[0]
            res["fla_train_vs_rollout"] = _diff(f_full[0, prompt:], f_dec)
            res["fla_chunk_vs_recurrent"] = _diff(f_full[0], f_rec_all[0])
            res["fla_chunk_vs_fp64"] = _diff(f_full[0], ref)
            res["fla_recurrent_vs_fp64"] = _diff(f_rec_all[0], ref)
            res["fla_output_dtype"] = str(f_full.dtype)
    return res


def run_case(spec: str, args: argparse.Namespace) -> dict:
    """One case, in this process: ``train:BxT``, ``prefill:T``, ``decode:B``, ``mismatch:PxD`` (each may end in
    ``@P``, a dot precision of the state pass)."""
    spec = _split_variant(spec)
    kind, _, size = spec.partition(":")
    if kind == "train":
        b, t = (int(x) for x in size.split("x"))
        return bench_train(b, t, args.quick, args.fla_bwd_unchecked)
    if kind == "prefill":
        return bench_prefill(int(size), args.quick)
    if kind == "decode":
        return bench_decode(int(size), args.quick)
    if kind == "mismatch":
        p, d = (int(x) for x in size.split("x"))
        return mismatch(p, d)
    raise SystemExit(f"--case {spec!r}: expected train:BxT, prefill:T, decode:B or mismatch:PxD")


def profile_case(spec: str, iters: int) -> dict:
    """Our forward of one case (``train:BxT``, ``prefill:T``, ``decode:B``; ``decodeclose:B``: a decode step in which
    every sequence closes its chunk, the step ``decode:B`` never times; ``trainbwd:BxT``: the training forward and
    backward, gradient of the output fixed; ``flatrain:BxT``, ``fladecode:B``: FLA's) under torch.profiler, after two
    warm calls (Triton compiles, plan cache filled): per-kernel device time, calls, launch shapes, and host
    vs device time of the ``iters`` profiled calls.

    ``host_ms_per_call``: wall time until the call returns (launches only, no sync); ``wall_ms_per_call``: with a device
    sync after the calls; ``device_busy_ms_per_call``: sum of self device time of all ops; ``kernel_span_ms_per_call``:
    the device time the kernels cover (overlapping kernels counted once). Device busy far below wall means the host (or
    gaps between kernels) is the bottleneck; device busy close to wall means the kernels themselves are slow, and the
    kernel table says which."""
    from megatron_iso.bench.profiling import (
        kernel_events,
        kernel_launches,
        kernel_span_ms,
        print_kernel_launches,
        print_summary,
        summarize,
    )

    spec = _split_variant(spec)
    kind, _, size = spec.partition(":")
    if kind in ("train", "trainbwd"):
        b, t = (int(x) for x in size.split("x"))
        fn, _ = _train_ours(b, t)
        if kind == "trainbwd":
            fwd, d_out = fn, torch.randn(b * t, HV, D, device=DEVICE)

            def fn() -> None:
                fwd().backward(d_out)
    elif kind == "flatrain":  # FLA's chunk forward on the same inputs: its per-kernel split, our budget
        b, t = (int(x) for x in size.split("x"))
        fla_chunk, _, fla_err = _fla()
        if fla_chunk is None:
            raise SystemExit(f"--profile {spec!r}: fla-core unavailable: {fla_err}")
        _, (q, k, v, g, beta) = _train_ours(b, t)
        fq, fk, fv = (x.bfloat16() for x in (q, k, v))

        def fn() -> None:
            fla_chunk(*[x.detach().requires_grad_(True) for x in (fq, fk, fv, g, beta)], scale=D**-0.5)
    elif kind == "prefill":
        fn, _ = _prefill_ours(int(size))
    elif kind in ("decode", "decodeclose"):
        fn, _ = _decode_ours(int(size), closing=kind == "decodeclose")
    elif kind == "fladecode":  # FLA's decode step on the same inputs: its device time beside ours
        _, fla_rec, fla_err = _fla()
        if fla_rec is None:
            raise SystemExit(f"--profile {spec!r}: fla-core unavailable: {fla_err}")
        fn = _decode_fla(fla_rec, _decode_ours(int(size))[1])
    else:
        raise SystemExit(
            f"--profile {spec!r}: expected train:BxT, trainbwd:BxT, flatrain:BxT, prefill:T, decode:B, decodeclose:B "
            "or fladecode:B"
        )
    cuda = DEVICE == "cuda"
    # the training forwards run with inputs that require grad, as in the bench
    with torch.set_grad_enabled(kind.startswith(("train", "flatrain"))):
        prof, host, wall = _profiled_calls(fn, iters)
    summary = summarize(prof, 15, device=cuda)
    events = kernel_events(prof) if cuda else []
    kernels = kernel_launches(events)
    span = kernel_span_ms(events) / iters if cuda else None
    busy = summary["device_busy_s"]
    row = {
        "case": "profile", "spec": spec, "iters": iters, "shape": {"Hk": HK, "Hv": HV, "D": D, "chunk": CHUNK},
        "host_ms_per_call": 1e3 * host / iters, "wall_ms_per_call": 1e3 * wall / iters,
        "device_busy_ms_per_call": None if busy is None else 1e3 * busy / iters, "kernel_span_ms_per_call": span,
        "kernels": kernels, "summary": summary,
    }  # fmt: skip
    print(f"profile {spec} ({iters} calls): host {row['host_ms_per_call']:.3f} ms/call, wall (synced) "
          f"{row['wall_ms_per_call']:.3f} ms/call, device busy {row['device_busy_ms_per_call']} ms/call, kernel span "
          f"{span} ms/call")  # fmt: skip
    if kernels:
        print_kernel_launches(kernels)
    print_summary(summary)
    return row


def kernel_resources(dot_precision: str | None = None, sass_dir: Path | None = None) -> dict:
    """Registers, spills and shared memory of every GDN kernel a decode step, a prefill that leaves a chunk open and a
    training forward + backward launch at the bench's Dk, Dv and chunk, compiled for sm_90a on this machine (no GPU
    needed: Triton's bundled ptxas). The calls run on CPU tensors with each launch replaced by a compile
    (``JITFunction.run`` intercepted): the signature comes from the launch's own arguments and constexprs, so it
    follows the kernels as they change. The numbers ptxas reports are static (per kernel), not dynamic counts.
    ``sass_dir``: also each kernel's SASS (Triton's bundled nvdisasm) as ``<kernel>[.<variant>].sass``."""
    import re
    import subprocess as sp
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from megatron_iso.ops.gdn import GDNLayerState
    from megatron_iso.ops.gdn.triton import config as G
    from megatron_iso.ops.gdn.triton.rule import gated_delta_rule

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("--resources compiles for the GPU: run it without TRITON_INTERPRET=1")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out: dict = {"target": "sm_90a", "triton": triton.__version__, "kernels": {}}

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)

    def compile_launch(fn: JITFunction, *args, grid, warmup, **kwargs) -> None:
        # Triton's own launch binding: the kernel signature, constexprs and the specialisations a launch on a GPU
        # gets (16-byte-aligned pointers and integers divisible by 16 marked so, which is what lets the compiler
        # vectorise loads; an integer 1 a constexpr). Without them every load compiles scalar here.
        bind = create_function_from_signature(fn.signature, fn.params, backend)
        options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, *bind(*args, **kwargs))
        consts = {fn.arg_names[path[0]]: v for path, v in constexprs.items()}
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        name = fn.fn.__name__
        key = (name, repr(sorted(consts.items())), repr(sorted(opts.items())), repr(sorted(attrs.items())))
        if key in seen:  # the same compiled kernel launched again
            return
        seen.add(key)
        name = f"{name} ({call[0]})" if name in out["kernels"] else name  # another variant, e.g. the training prep
        k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target, options=options.__dict__)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"{name}.ptx"
            src.write_text(k.asm["ptx"])
            log = sp.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                         capture_output=True, text=True, check=True).stderr  # fmt: skip
            if sass_dir is not None:
                sass = sp.run([str(ptxas.with_name("nvdisasm")), "-c", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
                sass_dir.mkdir(parents=True, exist_ok=True)
                variant = f".{dot_precision.replace(':', '_').replace('/', '_')}" if dot_precision else ""
                (sass_dir / f"{name}{variant}.sass").write_text(sass)

        def num(pattern: str) -> int | None:
            m = re.search(pattern, log)
            return int(m.group(1)) if m else None

        ptx = k.asm["ptx"]
        out["kernels"][name] = r = {
            "constexprs": {c: v if isinstance(v, (int, str, bool)) else str(v) for c, v in consts.items()}, **opts,
            "registers": num(r"Used (\d+) registers"), "stack_bytes": num(r"(\d+) bytes stack frame"),
            "spill_store_bytes": num(r"(\d+) bytes spill stores"), "spill_load_bytes": num(r"(\d+) bytes spill loads"),
            "shared_bytes": k.metadata.shared, "ptx_fma_f32": ptx.count("fma.rn.f32"),
            "ptx_bar_sync": ptx.count("bar.sync"), "ptx_vector_loads": len(re.findall(r"ld\.global[.\w]*\.v[248]\.", ptx)),
            # fp32 mul/add/sub that ptxas and LLVM may still contract into an fma (no .rn): none when the launch
            # passes enable_fp_fusion=False
            "enable_fp_fusion": options.enable_fp_fusion,
            "ptx_contractible_f32": len(re.findall(r"\b(?:mul|add|sub)\.f32\b", ptx)),
        }  # fmt: skip
        print(f"{name} {opts}: {r['registers']} regs, stack {r['stack_bytes']} B, spill st/ld "
              f"{r['spill_store_bytes']}/{r['spill_load_bytes']} B, shared {r['shared_bytes']} B, {r['ptx_fma_f32']} "
              f"fma.f32, {r['ptx_bar_sync']} bar.sync, {r['ptx_vector_loads']} vector loads (PTX)", flush=True)  # fmt: skip

    form, prec = parse_variant(dot_precision or G.DOT_PRECISION)
    kw = {"dot_precision": prec, "form": form or G.FORM, "chunk": CHUNK}
    hk, hv, n = HK, HV, 2 * CHUNK + 3  # the bench's head counts: strides and sizes specialise as on the GPU

    def inputs(t: int, grad: bool = False) -> list[torch.Tensor]:
        x = [torch.randn(t, hk, D), torch.randn(t, hk, D), torch.randn(t, hv, D), -torch.rand(t, hv), torch.rand(t, hv)]
        return [a.requires_grad_(grad) for a in x]

    state = GDNLayerState.allocate(2, conv_dim=1, conv_kernel=2, key_heads=hk, value_heads=hv, key_dim=D, value_dim=D,
                                   chunk=CHUNK, form=kw["form"], v_dtype=torch.bfloat16,
                                   u_dtype=G.state_u_dtype(kw["form"], prec),
                                   )  # fmt: skip
    one = torch.tensor([1])
    seen: set = set()
    call = ["prefill"]
    orig = JITFunction.run
    JITFunction.run = compile_launch
    try:
        x = inputs(n)
        x[2] = x[2].bfloat16()  # v as the model passes it
        gated_delta_rule(*x, torch.tensor([0, n]), state=state, slots=one, starts=torch.tensor([0]), **kw)
        call[0] = "decode"
        gated_delta_rule(*(a[:1] for a in x), torch.tensor([0, 1]), state=state, slots=one, starts=torch.tensor([n]),
                         **kw)  # fmt: skip
        call[0] = "train"
        gated_delta_rule(*inputs(n, True), torch.tensor([0, n]), **kw).sum().backward()
    finally:
        JITFunction.run = orig
    return out


def _child(args: argparse.Namespace) -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gdn needs a CUDA device (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    if DEVICE == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--device cpu needs TRITON_INTERPRET=1 (the parent process sets it)", file=sys.stderr)
            return 2
        _interpreter_setup()
    row = profile_case(args.case, args.profile_iters) if args.profile else run_case(args.case, args)
    row["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (TRITON_INTERPRET=1)"
    row["dot_precision"] = VARIANT  # None: the registered default through the dispatching op
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # an asynchronous fault surfaces here, inside this case
    print(RESULT_TAG + json.dumps(row), flush=True)
    return 0


# Tuning constants of ops/gdn/triton/config.py (and BWD_*: ops/gdn/triton/backward.py) that --tune may override in a
# run (each is read at launch time).
TUNABLE = (
    "SCAN_BV",
    "SCAN_WARPS",
    "CHAIN_BV",
    "CHAIN_BV_MMA",
    "CHAIN_BV_BF16",
    "CHAIN_WARPS",
    "CHAIN_STAGES",
    "PREP_WARPS",
    "PREP_STAGES",
    "INV_BLOCK",
    "OUT_BV",
    "OUT_WARPS",
    "DECODE_BV",
    "DECODE_WARPS",
    "DECODE_PREP_WARPS",
    "PREP_MAXNREG",
    "CHAIN_MAXNREG",
    "OUT_MAXNREG",
    "SCAN_MAXNREG",
    "DECODE_MAXNREG",
    "DECODE_PREP_MAXNREG",
    "BWD_BV",
    "BWD_CHAIN_BV",
    "BWD_CHAIN_BV_BF16",
    "BWD_KS",
    "BWD_WARPS",
    "BWD_CHAIN_WARPS",
    "BWD_CHAIN_STAGES",
    "BWD_MAXNREG",
    "BWD_CHAIN_MAXNREG",
)


def _apply_tune(pairs: list[str]) -> None:
    """``NAME=INT`` pairs onto the GDN Triton package's tuning constants. The kernels' bits follow some of them (the scan's
    layout, the inverse's block); training and rollout in one run use the same values, so the bitwise checks hold."""
    from megatron_iso.ops.gdn.triton import backward as B
    from megatron_iso.ops.gdn.triton import config as G

    for pair in pairs:
        name, _, val = pair.partition("=")
        if name not in TUNABLE or not val.lstrip("-").isdigit():
            raise SystemExit(f"--tune {pair!r}: expected NAME=INT with NAME one of {list(TUNABLE)}")
        n = int(val)
        if name.endswith("_MAXNREG"):  # a register cap: 0 (none) or what ptxas accepts for .maxnreg
            if n != 0 and not 24 <= n <= 255:
                raise SystemExit(f"--tune {pair!r}: a register cap is 0 (none) or in 24..255")
        elif n < 1 or (not name.endswith("_STAGES") and n & (n - 1)):
            raise SystemExit(f"--tune {pair!r}: the value must be >= 1, and a power of two unless NAME is *_STAGES")
        setattr(B if name.startswith("BWD_") else G, name, n)


def _meta(args: argparse.Namespace) -> dict:
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    # The parent never initialises CUDA; each row carries the device name its child saw.
    return {"device_kind": args.device, "torch": torch.__version__, "triton": version("triton"),
            "fla": version("fla-core") or version("flash-linear-attention"),
            "shape": {"Hk": HK, "Hv": HV, "Dk": D, "Dv": D, "chunk": CHUNK},
            "tune": args.tune}  # fmt: skip


def _print_row(row: dict) -> None:
    case = row["case"]
    if row.get("dot_precision"):
        print(f"[dot_precision {row['dot_precision']}] ", end="")
    if case == "train":
        bwd = row.get("fla_fwd_bwd_ms", row.get("fla_fwd_bwd", row.get("fla", "-")))
        bwd = f"{bwd:.3f}" if isinstance(bwd, float) else bwd
        if "fla_fwd_bwd_unchecked_ms" in row:
            bwd = f"{row['fla_fwd_bwd_unchecked_ms']:.3f} ms unchecked (its gated backward is refused here: {bwd})"
        print(f"train {row['batch']}x{row['T']}: fwd ours {row['ours_fwd_ms']:.3f} ms, fla "
              f"{row.get('fla_fwd_ms', math.nan):.3f} ms | fwd+bwd ours {row['ours_fwd_bwd_ms']:.3f} ms, "
              f"fla {bwd}", flush=True)  # fmt: skip
    elif case in ("prefill", "decode"):
        shape = f"T={row['T']}" if case == "prefill" else f"B={row['batch']}"
        fla_ms = row.get("fla_ms", math.nan)
        kernels = ""
        if "ours_over_fla_kernels" in row:
            kernels = (f" | kernels alone: ours {row['ours_kernel_ms']:.3f} ms, fla {row['fla_kernel_ms']:.3f} ms, "
                       f"ours/fla {row['ours_over_fla_kernels']:.2f}")  # fmt: skip
        print(f"{case} {shape}: ours {row['ours_ms']:.3f} ms, fla {fla_ms:.3f} ms, ours/fla "
              f"{row['ours_ms'] / fla_ms:.2f}{kernels}", flush=True)  # fmt: skip
    else:
        print(f"mismatch prompt={row['prompt']} decode={row['decode']}:", flush=True)
        for key in ("ours_train_vs_rollout", "ours_vs_fp64", "fla_train_vs_rollout", "fla_chunk_vs_recurrent",
                    "fla_chunk_vs_fp64", "fla_recurrent_vs_fp64"):  # fmt: skip
            if key in row:
                print(f"  {key:<26} max |d| {row[key]['max_abs']:.3e}  mean |d| {row[key]['mean_abs']:.3e}")
        print(f"  {'mean |o| (fp64)':<26} {row['mean_abs_o_fp64']:.3e}", flush=True)


def _variant_summary(result: dict) -> bool:
    """Per dot precision: training forward ms, ours vs fp64, train vs rollout (must be bitwise). True when every
    variant's mismatch row is bitwise (a missing row counts as not)."""
    ok = True
    print("variant          | train fwd ms | prefill ms | decode ms | ours vs fp64 max / mean | train vs rollout max "
          "|d|, bitwise")  # fmt: skip
    for prec in result["dot_precisions"]:
        rows: dict = {}
        for r in result["rows"]:  # the first row of each case (decode: the first --decode batch)
            if r.get("dot_precision") == prec:
                rows.setdefault(r["case"], r)
        tr, pf, dc, mm = (rows.get(c, {}) for c in ("train", "prefill", "decode", "mismatch"))
        fwd, pms, dms = tr.get("ours_fwd_ms", math.nan), pf.get("ours_ms", math.nan), dc.get("ours_ms", math.nan)
        if not mm:
            ok = False
            print(f"{prec:<16} | {fwd:12.3f} | {pms:10.3f} | {dms:9.3f} | mismatch case missing")
            continue
        e, d = mm["ours_vs_fp64"], mm["ours_train_vs_rollout"]
        ok = ok and d["bitwise_equal"]
        print(f"{prec:<16} | {fwd:12.3f} | {pms:10.3f} | {dms:9.3f} | {e['max_abs']:.3e} / {e['mean_abs']:.3e} | "
              f"{d['max_abs']:.3e}, {d['bitwise_equal']}")  # fmt: skip
    return ok


def _parent(args: argparse.Namespace) -> int:
    b, t = (int(x) for x in args.train.split("x"))
    prefills = [int(x) for x in args.prefill.split(",") if x]
    if args.dot_precision:  # the variants: the training forward, the first prefill length and the mismatch each
        cases = []
        for p in args.dot_precision:
            cases.append(f"train:{b}x{t}@{p}")
            cases += [f"prefill:{n}@{p}" for n in prefills[:1]]
            cases += [f"decode:{int(n)}@{p}" for n in args.decode.split(",") if n]
            cases.append(f"mismatch:{args.mm_prompt}x{args.mm_decode}@{p}")
    else:
        cases = [f"train:{b}x{t}"]
        cases += [f"prefill:{n}" for n in (prefills[:2] if args.quick else prefills)]
        cases += [f"decode:{int(n)}" for n in args.decode.split(",") if n]
        cases.append(f"mismatch:{args.mm_prompt}x{args.mm_decode}")
    env = dict(os.environ)
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    result = {**_meta(args), "cases": cases, "rows": [], "errors": {}, "dot_precisions": args.dot_precision or []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, str(Path(__file__).resolve()), "--device", args.device,
            "--shape", f"{HK},{HV},{D},{CHUNK}"] + (["--quick"] if args.quick else [])  # fmt: skip
    base += ["--tune", *args.tune] if args.tune else []
    base += ["--fla-bwd-unchecked"] if args.fla_bwd_unchecked else []
    t_all = time.time()
    for spec in cases:
        t0 = time.time()
        try:
            res = subprocess.run([*base, "--case", spec], env=env, capture_output=True, text=True,
                                 timeout=args.case_timeout)  # fmt: skip
            lines = [x for x in res.stdout.splitlines() if x.startswith(RESULT_TAG)]
            if res.returncode == 0 and lines:
                row = json.loads(lines[-1][len(RESULT_TAG) :])
                row["wall_s"] = round(time.time() - t0, 1)
                result["rows"].append(row)
                _print_row(row)
            else:
                result["errors"][spec] = f"exit {res.returncode}\n" + (res.stdout + res.stderr)[-6000:]
                print(f"{spec}: FAILED (exit {res.returncode})\n{(res.stdout + res.stderr)[-3000:]}", flush=True)
        except subprocess.TimeoutExpired as exc:
            tail = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
            result["errors"][spec] = f"timeout after {args.case_timeout}s\n" + tail[-6000:]
            print(f"{spec}: TIMEOUT after {args.case_timeout}s\n{tail[-3000:]}", flush=True)
        print(f"  ({spec}: {time.time() - t0:.1f}s)", file=sys.stderr, flush=True)
        result["wall_s"] = round(time.time() - t_all, 1)
        out.write_text(json.dumps(result, indent=1))  # after every case: a later crash keeps what is done
    print(f"wrote {out} ({len(result['rows'])} rows, {len(result['errors'])} errors, {result['wall_s']}s)")
    bitwise = _variant_summary(result) if args.dot_precision else True
    return 1 if result["errors"] or not bitwise else 0


def _profile_parent(args: argparse.Namespace) -> int:
    """--profile CASE: the case in its own subprocess (like the bench), its row written to --out."""
    env = dict(os.environ)
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--shape", f"{HK},{HV},{D},{CHUNK}",
           "--case", args.profile, "--profile", args.profile, "--profile-iters", str(args.profile_iters)]  # fmt: skip
    cmd += ["--tune", *args.tune] if args.tune else []
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.case_timeout)
    print("\n".join(x for x in res.stdout.splitlines() if not x.startswith(RESULT_TAG)), flush=True)
    lines = [x for x in res.stdout.splitlines() if x.startswith(RESULT_TAG)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {**_meta(args), "profile": json.loads(lines[-1][len(RESULT_TAG) :]) if lines else None}
    if res.returncode or not lines:
        result["error"] = f"exit {res.returncode}\n" + (res.stdout + res.stderr)[-6000:]
        print(result["error"][-3000:], file=sys.stderr)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 1 if "error" in result else 0


def main() -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_gdn.json")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, the first two prefill lengths")
    ap.add_argument("--train", default="8x4096", help="BxT of the training case")
    ap.add_argument("--prefill", default="512,1024,2048,4096,8192")
    ap.add_argument("--decode", default="1,64,256")
    ap.add_argument("--mm-prompt", type=int, default=1000)
    ap.add_argument("--mm-decode", type=int, default=200)
    ap.add_argument("--case-timeout", type=float, default=240.0, help="seconds per case (its subprocess)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: interpreter dry run")
    ap.add_argument("--shape", default=f"{HK},{HV},{D},{CHUNK}", help="Hk,Hv,D,chunk")
    ap.add_argument("--profile", metavar="CASE", help="profile our forward of one case (train:BxT, prefill:T, "
                    "decode:B; decodeclose:B: every sequence closing its chunk; trainbwd:BxT: forward + backward; "
                    "flatrain:BxT, fladecode:B: FLA's) under torch.profiler; writes the kernel table to "
                    "--out")  # fmt: skip
    ap.add_argument("--profile-iters", type=int, default=3, help="profiled calls (after two warm calls)")
    ap.add_argument("--resources", action="store_true", help="registers/spills/shared memory of the GDN kernels "
                    "(decode, prefill, training fwd+bwd) compiled for sm_90a with Triton's ptxas (CPU only); writes "
                    "to --out")  # fmt: skip
    ap.add_argument("--sass", metavar="DIR", help="with --resources: also write each kernel's SASS (nvdisasm) "
                    "into DIR")  # fmt: skip
    ap.add_argument("--dot-precision", nargs="+", metavar="V", help="time variants of our rule: a dot precision "
                    "(ieee, tf32x3, tf32, bf16, or PREP/CHAIN such as ieee/tf32x3), optionally after an output form "
                    "(chunk:bf16, scan:tf32): per variant the training forward, the first --prefill length, decode at "
                    "every --decode batch and the mismatch case (ours vs fp64, train vs rollout, which must be "
                    "bitwise); with --resources, the kernels compiled for each")  # fmt: skip
    ap.add_argument("--tune", nargs="+", metavar="NAME=INT", default=[], help="override GDN Triton tuning "
                    f"constants in this run (one of {', '.join(TUNABLE)}), e.g. SCAN_BV=8 SCAN_WARPS=1")  # fmt: skip
    ap.add_argument(
        "--fla-bwd-unchecked",
        action="store_true",
        help="where fla-core refuses its gated backward "
        "(Hopper, 3.4 <= Triton < 3.7.1: wrong db/dg, fla #640), run it anyway and report its fwd+bwd time "
        "as fla_fwd_bwd_unchecked_ms: a speed anchor, not a correct backward",
    )
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = ap.parse_args()
    if args.mm_prompt < 1 or args.mm_decode < 0:
        ap.error("--mm-prompt must be >= 1 and --mm-decode >= 0")
    if args.sass and not args.resources:
        ap.error("--sass goes with --resources (the SASS of the kernels it compiles)")
    DEVICE = args.device
    _set_shape(args.shape)
    _apply_tune(args.tune)
    if args.dot_precision:
        for p in args.dot_precision:
            try:
                parse_variant(p)
            except ValueError as e:
                ap.error(f"--dot-precision {p!r}: {e}")
    if args.resources:
        sass = Path(args.sass) if args.sass else None
        res = (
            {p: kernel_resources(p, sass) for p in args.dot_precision}
            if args.dot_precision
            else kernel_resources(sass_dir=sass)
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**_meta(args), "resources": res}, indent=1))
        return 0
    if args.profile and not args.case:  # the child (--case) runs the profile itself
        return _profile_parent(args)
    return _child(args) if args.case else _parent(args)


if __name__ == "__main__":
    sys.exit(main())
