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

Dot-precision variants of the state pass (``triton.tuning.DOT_PRECISIONS``, or ``PREP/CHAIN`` such as
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
from pathlib import Path

import torch

from megatron_iso.bench.kernels import gdn_setup as setup
from megatron_iso.bench.kernels.gdn_cases import run_case
from megatron_iso.bench.kernels.gdn_profile import kernel_resources, profile_case
from megatron_iso.bench.kernels.gdn_setup import TUNABLE, apply_tune, interpreter_setup, parse_variant

# The line of a --case child's stdout that carries its row (JSON) back to the parent.
RESULT_TAG = "BENCH_GDN_CASE_RESULT "


def _child(args: argparse.Namespace) -> int:
    if setup.DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gdn needs a CUDA device (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    if setup.DEVICE == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--device cpu needs TRITON_INTERPRET=1 (the parent process sets it)", file=sys.stderr)
            return 2
        interpreter_setup()
    row = profile_case(args.case, args.profile_iters) if args.profile else run_case(args.case, args)
    row["device"] = torch.cuda.get_device_name() if setup.DEVICE == "cuda" else "cpu (TRITON_INTERPRET=1)"
    row["dot_precision"] = setup.VARIANT  # None: the registered default through the dispatching op
    if setup.DEVICE == "cuda":
        torch.cuda.synchronize()  # an asynchronous fault surfaces here, inside this case
    print(RESULT_TAG + json.dumps(row), flush=True)
    return 0


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
            "shape": {"Hk": setup.HK, "Hv": setup.HV, "Dk": setup.D, "Dv": setup.D, "chunk": setup.CHUNK},
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
            "--shape", f"{setup.HK},{setup.HV},{setup.D},{setup.CHUNK}"] + (["--quick"] if args.quick else [])  # fmt: skip
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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device,
           "--shape", f"{setup.HK},{setup.HV},{setup.D},{setup.CHUNK}", "--case", args.profile,
           "--profile", args.profile, "--profile-iters", str(args.profile_iters)]  # fmt: skip
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
    ap.add_argument("--shape", default=f"{setup.HK},{setup.HV},{setup.D},{setup.CHUNK}", help="Hk,Hv,D,chunk")
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
    setup.configure(args.device, args.shape)
    apply_tune(args.tune)
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
