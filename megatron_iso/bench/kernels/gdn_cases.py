"""Gated DeltaNet bench cases, ours vs FLA (``tools/bench_gdn.py``; the module docstring there says what each
row holds): the training forward and forward + backward, prefill, decode, and the train-vs-rollout mismatch against
an fp64 recurrence. Each reads the case setting of ``gdn_setup``."""

from __future__ import annotations

import argparse
import time

import torch

from megatron_iso.bench.kernels import gdn_setup as setup
from megatron_iso.bench.kernels.gdn_setup import (
    bench_ms,
    cu_seqlens,
    fla_bwd_refused,
    fla_bwd_unavailable,
    fla_entry_points,
    make_inputs,
    make_state,
    our_rule,
    split_variant,
)


def train_ours(b: int, t: int):
    """(ours_fwd, inputs): our training forward on a packed b x t batch (inputs that require grad)."""
    rule = our_rule()
    q, k, v, g, beta = make_inputs(b, t, 1)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    flat[2] = flat[2].bfloat16()  # the model's v is in the model dtype; q, k come from l2norm in fp32
    cu = cu_seqlens([t] * b)

    def ours_fwd():
        return rule(*[x.detach().requires_grad_(True) for x in flat], cu, chunk=setup.CHUNK)

    return ours_fwd, (q, k, v, g, beta)


def bench_train(b: int, t: int, quick: bool, fla_bwd_unchecked: bool = False) -> dict:
    """``fla_bwd_unchecked``: time FLA's fwd+bwd where fla-core refuses its gated backward (speed only)."""
    fla_chunk, _, fla_err = fla_entry_points()
    ours_fwd, (q, k, v, g, beta) = train_ours(b, t)
    dout = torch.randn(b * t, setup.HV, setup.D, device=setup.DEVICE)
    row: dict = {"case": "train", "batch": b, "T": t}
    row["ours_fwd_ms"] = bench_ms(ours_fwd, quick)
    row["ours_fwd_bwd_ms"] = bench_ms(lambda: ours_fwd().backward(dout), quick)
    if fla_chunk is None:
        row["fla"] = "unavailable: " + (fla_err or "").strip().splitlines()[-1]
        return row
    fq, fk, fv = (x.bfloat16() for x in (q, k, v))
    fdo = dout.reshape(b, t, setup.HV, setup.D).bfloat16()

    def fla_fwd():
        return fla_chunk(*[x.detach().requires_grad_(True) for x in (fq, fk, fv, g, beta)], scale=setup.D**-0.5)[0]

    row["fla_fwd_ms"] = bench_ms(fla_fwd, quick)
    row["ours_over_fla_fwd"] = row["ours_fwd_ms"] / row["fla_fwd_ms"]
    refused = fla_bwd_refused()
    if refused is not None and fla_bwd_unchecked:
        from fla.ops.common import chunk_o

        # Lift fla-core's own refusal for this process: its gated backward then runs, with the db/dg that fla
        # #640 says are wrong on this Triton. Only its time is kept, as the fwd+bwd anchor (never its gradients).
        chunk_o.TRITON_ABOVE_3_7_1 = True
        row["fla_fwd_bwd_unchecked_ms"] = bench_ms(lambda: fla_fwd().backward(fdo), quick)
        row["ours_over_fla_fwd_bwd_unchecked"] = row["ours_fwd_bwd_ms"] / row["fla_fwd_bwd_unchecked_ms"]
    if refused is not None:
        row["fla_fwd_bwd"] = refused
        return row
    try:
        fla_fwd().backward(fdo)  # once outside the timer: FLA may refuse its backward on this GPU/Triton
    except (RuntimeError, NotImplementedError) as exc:
        reason = fla_bwd_unavailable(exc)
        if reason is None:
            raise
        row["fla_fwd_bwd"] = reason
        return row
    row["fla_fwd_bwd_ms"] = bench_ms(lambda: fla_fwd().backward(fdo), quick)
    row["ours_over_fla_fwd_bwd"] = row["ours_fwd_bwd_ms"] / row["fla_fwd_bwd_ms"]
    return row


def prefill_ours(t: int):
    """(ours, inputs): our prefill of one t-token sequence from a fresh state (call under no_grad)."""
    rule = our_rule()
    q, k, v, g, beta = (x[0] for x in make_inputs(1, t, 2))
    st = make_state(1)
    cu, slots, starts = cu_seqlens([t]), torch.tensor([0], device=setup.DEVICE), torch.tensor([0], device=setup.DEVICE)
    vb = v.bfloat16()
    return (lambda: rule(q, k, vb, g, beta, cu, chunk=setup.CHUNK, state=st, slots=slots, starts=starts)), (
        q,
        k,
        v,
        g,
        beta,
    )


def bench_prefill(t: int, quick: bool) -> dict:
    fla_chunk, _, _ = fla_entry_points()
    ours, (q, k, v, g, beta) = prefill_ours(t)
    row: dict = {"case": "prefill", "T": t}
    with torch.no_grad():
        row["ours_ms"] = bench_ms(ours, quick)
        if fla_chunk is not None:
            args = [x[None].bfloat16() for x in (q, k, v)] + [g[None], beta[None]]  # [1, T, H(, D)]
            row["fla_ms"] = bench_ms(lambda: fla_chunk(*args, scale=setup.D**-0.5, output_final_state=True), quick)
            row["ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
    return row


def decode_starts(n: int, closing: bool = False) -> torch.Tensor:
    """Positions of n decoding sequences, all mid-chunk (1 .. C-2 tokens buffered, past two chunks), so
    one more token never closes a chunk; ``closing``: all at a chunk's last position (C - 1 buffered), so the step
    closes every sequence's chunk (the chain's exit state, once in C steps of a sequence)."""
    if closing:
        return torch.full((n,), 3 * setup.CHUNK - 1, device=setup.DEVICE)
    return 2 * setup.CHUNK + 1 + torch.arange(n, device=setup.DEVICE) % max(setup.CHUNK - 2, 1)


def decode_ours(n: int, closing: bool = False):
    """(ours, inputs): one decode step of n sequences from their cached states (under no_grad), mid-chunk or, with
    ``closing``, each closing its chunk."""
    rule = our_rule()
    q, k, v, g, beta = (x[:, 0] for x in make_inputs(n, 1, 3))  # [n, H(, D)]: one token per sequence
    st = make_state(n)
    st.running.normal_()
    cu = cu_seqlens([1] * n)
    slots = torch.arange(n, device=setup.DEVICE)  # one slot per sequence, all inside the n-slot cache
    starts = decode_starts(n, closing)
    assert int(slots.max()) < st.running.shape[0] and bool(
        (((starts % setup.CHUNK) + 1 == setup.CHUNK) == closing).all()
    )
    vb = v.bfloat16()
    return (lambda: rule(q, k, vb, g, beta, cu, chunk=setup.CHUNK, state=st, slots=slots, starts=starts)), (
        q,
        k,
        v,
        g,
        beta,
    )


def decode_fla(fla_rec, inputs: tuple[torch.Tensor, ...]):
    """FLA's decode step (fused recurrent, one token per sequence from its state) on ``decode_ours``'s inputs.

    FLA 0.6.0: fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...): the 5th positional is gk (per-key
    decay [B, T, Hv, Dk]), so beta goes by keyword. q, k [B, 1, Hk, D]; v [B, 1, Hv, D]; g, beta [B, 1, Hv];
    initial_state [B, Hv, Dk, Dv] fp32 (the K-first layout, state_v_first=False)."""
    q, k, v, g, beta = inputs
    fq, fk, fv = (x[:, None].bfloat16().contiguous() for x in (q, k, v))
    fg, fb = g[:, None].contiguous(), beta[:, None].contiguous()
    h0 = torch.randn(q.shape[0], setup.HV, setup.D, setup.D, device=setup.DEVICE)
    return lambda: fla_rec(fq, fk, fv, fg, beta=fb, scale=setup.D**-0.5, initial_state=h0, output_final_state=True)


def profiled_calls(fn, iters: int, warm: int = 2) -> tuple[torch.profiler.profile, float, float]:
    """``iters`` calls of ``fn`` under torch.profiler (CUDA activity on the GPU), after ``warm`` unprofiled ones:
    the profile, the host seconds spent inside the calls, and the wall seconds of all of them with a final sync."""
    cuda = setup.DEVICE == "cuda"

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


def kernel_ms(fn, iters: int = 5) -> float | None:
    """Device time of ``fn``'s kernels per call: the kernels alone, without the Python wrapper that ``do_bench``'s
    figure includes wherever the host is slower than the device; the time they cover, so kernels that overlap (a
    programmatic dependent launch) count once. None off the GPU."""
    if setup.DEVICE != "cuda":
        return None
    from megatron_iso.bench.profiling import kernel_events, kernel_span_ms

    prof, _, _ = profiled_calls(fn, iters, warm=1)
    return kernel_span_ms(kernel_events(prof)) / iters


def bench_decode(n: int, quick: bool) -> dict:
    _, fla_rec, _ = fla_entry_points()
    ours, inputs = decode_ours(n)
    row: dict = {"case": "decode", "batch": n}
    with torch.no_grad():
        row["ours_ms"] = bench_ms(ours, quick)
        row["ours_kernel_ms"] = kernel_ms(ours)
        if fla_rec is not None:
            fla = decode_fla(fla_rec, inputs)
            row["fla_ms"] = bench_ms(fla, quick)
            row["fla_kernel_ms"] = kernel_ms(fla)
            row["ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
            if row["ours_kernel_ms"] and row["fla_kernel_ms"]:
                row["ours_over_fla_kernels"] = row["ours_kernel_ms"] / row["fla_kernel_ms"]
    return row


def _naive64(q, k, v, g, beta):
    """fp64 recurrence: q, k [T, HK, D]; v [T, HV, D]; g, beta [T, HV] -> [T, HV, D]."""
    rep = setup.HV // setup.HK
    q, k = (x.double().repeat_interleave(rep, 1) for x in (q, k))  # value head h reads key head h // rep
    q = q * setup.D**-0.5
    v, g, beta = v.double(), g.double(), beta.double()
    s = torch.zeros(setup.HV, setup.D, setup.D, dtype=torch.float64, device=q.device)
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
    rule = our_rule()
    fla_chunk, fla_rec, _ = fla_entry_points()
    t = prompt + decode
    q, k, v, g, beta = (x[0] for x in make_inputs(1, t, 4))
    q, k, v = (x.bfloat16() for x in (q, k, v))  # the same rounded inputs for every path
    res: dict = {"case": "mismatch", "prompt": prompt, "decode": decode}
    with torch.no_grad():
        ref = _naive64(q, k, v, g, beta)
        res["mean_abs_o_fp64"] = float(ref.abs().mean())
        full = rule(q, k, v, g, beta, cu_seqlens([t]), chunk=setup.CHUNK)
        st = make_state(1)
        outs, pos = [], 0
        for n in [prompt] + [1] * decode:
            r = slice(pos, pos + n)
            outs.append(rule(q[r], k[r], v[r], g[r], beta[r], cu_seqlens([n]), chunk=setup.CHUNK, state=st,
                             slots=torch.tensor([0], device=setup.DEVICE),
                             starts=torch.tensor([pos], device=setup.DEVICE)))  # fmt: skip
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
                return fla_rec(q5[:, sl], k5[:, sl], v5[:, sl], g5[:, sl], beta=b5[:, sl], scale=setup.D**-0.5,
                               initial_state=h0, output_final_state=h0 is not None)  # fmt: skip

            f_full, _ = fla_chunk(q5, k5, v5, g5, b5, scale=setup.D**-0.5)
            f_rec_all, _ = rec(slice(0, t))
            _, h = fla_chunk(q5[:, :prompt], k5[:, :prompt], v5[:, :prompt], g5[:, :prompt], b5[:, :prompt],
                             scale=setup.D**-0.5, output_final_state=True)  # fmt: skip
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
    spec = split_variant(spec)
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
