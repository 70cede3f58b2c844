"""Gated DeltaNet on one GPU: ours (ops.gdn, cuda/correctness = CPR Triton kernels) vs FLA, per layer.

Shapes: one Qwen3-Next GDN layer (conf/model/qwen3_next_80b_a3b.yaml: Hk=16, Hv=32, Dk=Dv=128; CPR chunk 64).

Timings (median ms, ``triton.testing.do_bench``; Python wrapper time included, no CUDA graphs):
- ``train``: packed batch x T tokens, forward + backward (ours: the invariant forward, the native chunked
  torch formula's backward; FLA: ``chunk_gated_delta_rule`` forward + backward, bf16 q/k/v).
- ``prefill``: one sequence of T tokens from a fresh state, forward only, final state kept (ours: into the
  GDN state cache; FLA: ``chunk_gated_delta_rule(output_final_state=True)``).
- ``decode``: one token for each of B sequences, each mid-chunk, from its cached state (ours: the scan kernel
  from the running state; FLA: ``fused_recurrent_gated_delta_rule`` with ``initial_state``). Ours is timed
  with its per-call plan cached, as in a model forward where every GDN layer reuses the plan of the first.

Mismatch (``mismatch`` in the JSON), on one sequence of ``--mm-prompt`` prompt + ``--mm-decode`` decoded
tokens, random inputs shaped like the model's (q, k l2-normalised; v ~ N(0, 1); g from A_log = log U(1, 16),
dt_bias = 1; beta = sigmoid(N(0, 1))), all value heads, outputs o of the rule (before the gated norm):
- ``fla_train_vs_rollout``: FLA's training forward (``chunk_gated_delta_rule`` over the whole sequence) vs
  FLA's rollout (chunk prefill of the prompt, then ``fused_recurrent_gated_delta_rule`` one token at a time from
  the carried state), on the decoded tokens' outputs: max |d| and mean |d| over tokens x heads x Dv, in the
  inputs' dtype (bf16 q/k/v, as FLA is used in training and serving), plus mean |o| for scale. This is the
  trainer-vs-rollout gap of a stock stack at the rule.
- ``fla_chunk_vs_recurrent``: FLA chunk vs FLA fused recurrent over the whole sequence (every token).
- ``ours_train_vs_rollout``: ours, training forward vs prefill + token-by-token decode: max |d| (must be 0)
  and whether all bits are equal.
- ``*_vs_fp64``: each output vs an fp64 recurrence on the same (bf16-rounded) inputs: max / mean |d|.

Usage: ``python3 tools/bench_gdn.py --out $OUT/bench_gdn.json`` (``--quick`` for a short run). FLA is used
when ``import fla`` works (wheel fla-core + einops); otherwise its rows say why they are missing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

HK, HV, D, CHUNK = 16, 32, 128, 64


def _inputs(b: int, t: int, seed: int, device: str = "cuda"):
    """q, k (l2-normalised fp32), v (fp32), g, beta (fp32), shaped [b, t, H, D] / [b, t, H]."""
    from megatron_iso.ops.gdn import native

    gen = torch.Generator(device=device).manual_seed(seed)
    q = native.l2norm(torch.randn(b, t, HK, D, device=device, generator=gen))
    k = native.l2norm(torch.randn(b, t, HK, D, device=device, generator=gen))
    v = torch.randn(b, t, HV, D, device=device, generator=gen)
    a = torch.randn(b, t, HV, device=device, generator=gen)
    a_log = torch.empty(HV, device=device).uniform_(1, 16, generator=gen).log()
    g = -a_log.exp() * torch.nn.functional.softplus(a + 1.0)
    beta = torch.sigmoid(torch.randn(b, t, HV, device=device, generator=gen))
    return q, k, v, g, beta


def _bench(fn, quick: bool) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median"))


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, None
    except Exception:  # report why, keep our rows
        return None, None, traceback.format_exc(limit=3)


def _state(slots: int):
    from megatron_iso.ops.gdn import GDNLayerState

    return GDNLayerState.allocate(slots, conv_dim=4, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D,
                                  value_dim=D, chunk=CHUNK, dtype=torch.bfloat16, device="cuda")  # fmt: skip


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def bench_train(b: int, t: int, quick: bool, fla_chunk) -> dict:
    from megatron_iso.ops.gdn import gated_delta_rule

    q, k, v, g, beta = _inputs(b, t, 1)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    flat[2] = flat[2].bfloat16()  # the model's v is in the model dtype; q, k come from l2norm in fp32
    cu = _cu([t] * b)
    dout = torch.randn(b * t, HV, D, device="cuda")
    row = {"case": "train_fwd_bwd", "batch": b, "T": t}

    def ours():
        leaves = [x.detach().requires_grad_(True) for x in flat]
        gated_delta_rule(*leaves, cu, chunk=CHUNK).backward(dout)

    row["ours_ms"] = _bench(ours, quick)
    if fla_chunk is not None:
        fq, fk, fv = (x.bfloat16() for x in (q, k, v))
        fdo = dout.reshape(b, t, HV, D).bfloat16()

        def fla():
            leaves = [x.detach().requires_grad_(True) for x in (fq, fk, fv, g, beta)]
            o, _ = fla_chunk(*leaves, scale=D**-0.5)
            o.backward(fdo)

        row["fla_ms"] = _bench(fla, quick)
    return row


def bench_prefill(t: int, quick: bool, fla_chunk) -> dict:
    from megatron_iso.ops.gdn import gated_delta_rule

    q, k, v, g, beta = (x[0] for x in _inputs(1, t, 2))
    st = _state(1)
    cu, slots, starts = _cu([t]), torch.tensor([0], device="cuda"), torch.tensor([0], device="cuda")
    vb = v.bfloat16()
    row = {"case": "prefill", "T": t}
    with torch.no_grad():
        row["ours_ms"] = _bench(
            lambda: gated_delta_rule(q, k, vb, g, beta, cu, chunk=CHUNK, state=st, slots=slots, starts=starts), quick
        )
        if fla_chunk is not None:
            args = [x[None].bfloat16() for x in (q, k, v)] + [g[None], beta[None]]
            row["fla_ms"] = _bench(lambda: fla_chunk(*args, scale=D**-0.5, output_final_state=True), quick)
    return row


def bench_decode(n: int, quick: bool, fla_rec) -> dict:
    from megatron_iso.ops.gdn import gated_delta_rule

    q, k, v, g, beta = (x[:, 0] for x in _inputs(n, 1, 3))
    st = _state(n)
    st.running.normal_()
    cu = _cu([1] * n)
    slots = torch.arange(n, device="cuda")
    starts = 100 + torch.arange(n, device="cuda") % 20  # mid-chunk positions: no chunk closes
    vb = v.bfloat16()
    row = {"case": "decode", "batch": n}
    with torch.no_grad():
        row["ours_ms"] = _bench(
            lambda: gated_delta_rule(q, k, vb, g, beta, cu, chunk=CHUNK, state=st, slots=slots, starts=starts), quick
        )
        if fla_rec is not None:
            args = [x[:, None].bfloat16() for x in (q, k, v)] + [g[:, None], beta[:, None]]
            h0 = torch.randn(n, HV, D, D, device="cuda")
            row["fla_ms"] = _bench(
                lambda: fla_rec(*args, scale=D**-0.5, initial_state=h0, output_final_state=True), quick
            )
    return row


def _naive64(q, k, v, g, beta):
    """fp64 recurrence on the GPU: q, k [T, HK, D]; v [T, HV, D]; g, beta [T, HV] -> [T, HV, D]."""
    rep = HV // HK
    q, k = (x.double().repeat_interleave(rep, 1) for x in (q, k))
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


def mismatch(prompt: int, decode: int, fla_chunk, fla_rec) -> dict:
    from megatron_iso.ops.gdn import gated_delta_rule

    t = prompt + decode
    q, k, v, g, beta = (x[0] for x in _inputs(1, t, 4))
    q, k, v = (x.bfloat16() for x in (q, k, v))  # the same rounded inputs for every path
    res: dict = {"prompt": prompt, "decode": decode}
    with torch.no_grad():
        ref = _naive64(q, k, v, g, beta)
        res["mean_abs_o_fp64"] = float(ref.abs().mean())
        full = gated_delta_rule(q, k, v, g, beta, _cu([t]), chunk=CHUNK)
        st = _state(1)
        outs, pos = [], 0
        for n in [prompt] + [1] * decode:
            r = slice(pos, pos + n)
            outs.append(gated_delta_rule(q[r], k[r], v[r], g[r], beta[r], _cu([n]), chunk=CHUNK, state=st,
                                         slots=torch.tensor([0], device="cuda"),
                                         starts=torch.tensor([pos], device="cuda")))  # fmt: skip
            pos += n
        inc = torch.cat(outs)
        res["ours_train_vs_rollout"] = {
            **_diff(full, inc),
            "bitwise_equal": bool(torch.equal(full.view(torch.int32), inc.view(torch.int32))),
        }
        res["ours_vs_fp64"] = _diff(full, ref)
        if fla_chunk is not None:
            a5 = [x[None] for x in (q, k, v, g, beta)]
            f_full, _ = fla_chunk(*a5, scale=D**-0.5)
            f_rec_all, _ = fla_rec(*a5, scale=D**-0.5)
            _, h = fla_chunk(*(x[:, :prompt] for x in a5), scale=D**-0.5, output_final_state=True)
            dec = []
            for i in range(prompt, t):
                o, h = fla_rec(*(x[:, i : i + 1] for x in a5), scale=D**-0.5, initial_state=h, output_final_state=True)
                dec.append(o)
            f_dec = torch.cat(dec, 1)[0]
            res["fla_train_vs_rollout"] = _diff(f_full[0, prompt:], f_dec)
            res["fla_chunk_vs_recurrent"] = _diff(f_full[0], f_rec_all[0])
            res["fla_chunk_vs_fp64"] = _diff(f_full[0], ref)
            res["fla_recurrent_vs_fp64"] = _diff(f_rec_all[0], ref)
            res["fla_output_dtype"] = str(f_full.dtype)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_gdn.json")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and shapes")
    ap.add_argument("--train", default="8x4096", help="BxT of the training case")
    ap.add_argument("--prefill", default="512,1024,2048,4096,8192")
    ap.add_argument("--decode", default="1,64,256")
    ap.add_argument("--mm-prompt", type=int, default=1000)
    ap.add_argument("--mm-decode", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gdn needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    fla_chunk, fla_rec, fla_err = _fla()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"Hk": HK, "Hv": HV, "Dk": D, "Dv": D, "chunk": CHUNK},
        "fla": None if fla_chunk is None else __import__("fla").__version__,
        "fla_error": fla_err,
        "rows": [],
        "errors": {},
    }
    b, t = (int(x) for x in args.train.split("x"))
    jobs = [(f"train {b}x{t}", lambda: bench_train(b, t, args.quick, fla_chunk))]
    prefills = [int(x) for x in args.prefill.split(",")][: 2 if args.quick else None]
    jobs += [(f"prefill {n}", lambda n=n: bench_prefill(n, args.quick, fla_chunk)) for n in prefills]
    jobs += [
        (f"decode {n}", lambda n=n: bench_decode(n, args.quick, fla_rec)) for n in map(int, args.decode.split(","))
    ]
    for name, job in jobs:
        t0 = time.time()
        try:
            row = job()
            if "fla_ms" in row:
                row["ours_over_fla"] = row["ours_ms"] / row["fla_ms"]
            result["rows"].append(row)
        except Exception:
            result["errors"][name] = traceback.format_exc()
            print(result["errors"][name], file=sys.stderr)
        torch.cuda.empty_cache()
        print(f"{name}: {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    try:
        result["mismatch"] = mismatch(args.mm_prompt, args.mm_decode, fla_chunk, fla_rec)
    except Exception:
        result["errors"]["mismatch"] = traceback.format_exc()
        print(result["errors"]["mismatch"], file=sys.stderr)
    print(f"\nGDN layer, Hk={HK} Hv={HV} Dk=Dv={D}, {result['device']}, fla {result['fla']}")
    print(f"{'case':<16}{'shape':>12}{'ours ms':>12}{'fla ms':>12}{'ours/fla':>10}")
    for r in result["rows"]:
        shape = f"{r.get('batch', 1)}x{r.get('T', 1)}"
        fla_ms = r.get("fla_ms", math.nan)
        print(f"{r['case']:<16}{shape:>12}{r['ours_ms']:>12.3f}{fla_ms:>12.3f}{r['ours_ms'] / fla_ms:>10.2f}")
    mm = result.get("mismatch", {})
    for key in ("ours_train_vs_rollout", "ours_vs_fp64", "fla_train_vs_rollout", "fla_chunk_vs_recurrent",
                "fla_chunk_vs_fp64", "fla_recurrent_vs_fp64"):  # fmt: skip
        if key in mm:
            print(f"{key:<26} max |d| {mm[key]['max_abs']:.3e}  mean |d| {mm[key]['mean_abs']:.3e}")
    if "mean_abs_o_fp64" in mm:
        print(f"{'mean |o| (fp64)':<26} {mm['mean_abs_o_fp64']:.3e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
