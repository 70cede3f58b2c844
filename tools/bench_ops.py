"""Check and time the Triton (GPU) correctness-profile ops against their stock baselines.

Every run checks before it times: batch invariance (row 0 bitwise across M), the TP-subtree
identity of the leaf tree, and that the M-dependent schedule never changes a bit. Then it times the
leaf-tree GEMM against cuBLAS (``x @ w.t()``) and the memory-bound ops against the copy bandwidth
measured in the same run. All timings are CUDA-graph replays (``triton.testing.do_bench_cudagraph``,
median), so launch overhead of the Python wrappers is not what is measured: decode runs under graphs.

    python tools/bench_ops.py --out bench.json            # full table (M x N x K grid)
    python tools/bench_ops.py --sweep --out sweep.json    # tile/park variants of the G=8 GEMM
    python tools/bench_ops.py --tiles --attention --skip-gemm --skip-mem   # tile equivalence, attention
    python tools/bench_ops.py --decode-tiles --skip-gemm --skip-mem        # tiles of the models' decode GEMMs
    python tools/bench_ops.py --attention-split --skip-gemm --skip-mem     # batch-1 decode: split vs unsplit
    python tools/bench_ops.py --attention-backward-sweep --skip-gemm --skip-mem   # backward tile candidates
    python tools/bench_ops.py --moe --skip-gemm --skip-mem --out moe.json  # grouped expert GEMM (Qwen3-30B-A3B)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from typing import Any

import torch

from megatron_iso.bench.kernels.attention import (
    attention_backward_bench,
    attention_backward_sweep,
    attention_bench,
    attention_checks,
    attention_decode_split_rows,
)
from megatron_iso.bench.kernels.gemm import (
    decode_tile_sweep,
    gemm_candidates,
    gemm_checks,
    gemm_sweep,
    gemm_table,
    gemm_tile_equivalence,
)
from megatron_iso.bench.kernels.memory import entropy_bench, logprob_bench, norm_bench
from megatron_iso.bench.kernels.moe import MOE_TOKENS, moe_bench
from megatron_iso.bench.kernels.timing import copy_bandwidth


def _record(res: dict[str, Any], key: str, call) -> None:
    """``res[key] = call()``; a failure is recorded there and printed, and the other benches still run."""
    try:
        res[key] = call()
    except Exception as exc:
        res[key] = {"error": repr(exc)[:500]}
        print(key, "ERROR", repr(exc)[:500], flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_ops.json")
    ap.add_argument("--sweep", action="store_true", help="time tile/park variants instead of the full table")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--sweep-large-only", action="store_true", help="with --sweep: skip the small-M schedules")
    ap.add_argument("--tiles", action="store_true", help="tile-equivalence experiment and G=1 tile candidates")
    ap.add_argument("--decode-tiles", action="store_true", help="tile candidates on the models' decode GEMMs")
    ap.add_argument("--attention", action="store_true", help="attention checks and timing vs SDPA, decode split")
    ap.add_argument("--attention-split", action="store_true", help="only the batch-1 decode split vs unsplit rows")
    ap.add_argument("--attention-backward", action="store_true", help="training attention backward vs SDPA")
    ap.add_argument("--attention-backward-sweep", action="store_true", help="the backward kernels' tile candidates")
    ap.add_argument("--skip-mem", action="store_true", help="skip RMSNorm / logprob / entropy")
    ap.add_argument("--moe", action="store_true", help="grouped expert GEMM vs per-expert cuBLAS / leaf-tree loops")
    ap.add_argument("--moe-tokens", default=",".join(map(str, MOE_TOKENS)), help="comma-separated token counts")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    from megatron_iso.bench.provenance import code_identity
    from megatron_iso.ops.gemm import gemm_triton as gt

    t0 = time.time()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(sys.argv),
        **code_identity(),
        "gemm_config_bf16": dataclasses.asdict(gt.CONFIGS[torch.bfloat16]),
        "gemm_selectable_tiles_bf16": [dataclasses.asdict(c) for c in gt.selectable_tiles(torch.bfloat16)],
    }
    res["copy_GBps"] = bw = copy_bandwidth()
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    for key, call in (
        ("gemm_checks_bf16", gemm_checks),
        ("gemm_checks_fp32", lambda: gemm_checks((1, 8), torch.float32)),
    ):
        try:
            res[key] = call()
        except Exception as exc:  # keep timing the rest; the failure is recorded and printed
            res[key] = {"error": repr(exc)[:500]}
    print(json.dumps({"bf16": res["gemm_checks_bf16"], "fp32": res["gemm_checks_fp32"]}, indent=1), flush=True)
    if args.attention:
        _record(res, "attention_checks", attention_checks)
        _record(res, "attention", attention_bench)
    if args.attention_split and not args.attention:
        _record(res, "attention_decode_split", attention_decode_split_rows)
    if args.attention_backward:
        _record(res, "attention_backward", attention_backward_bench)
    if args.attention_backward_sweep:
        _record(res, "attention_backward_sweep", attention_backward_sweep)
    if args.moe:
        _record(res, "moe", lambda: moe_bench(tuple(int(t) for t in args.moe_tokens.split(","))))
    if args.tiles:
        res["tile_equivalence"] = gemm_tile_equivalence()
        res["gemm_candidates"] = gemm_candidates()
    if args.decode_tiles:
        res["decode_tile_sweep"] = decode_tile_sweep()
    if args.sweep:
        res["sweep"] = gemm_sweep(not args.sweep_large_only)
    if not args.skip_gemm:
        res["gemm"] = gemm_table()
    mem_benches = (("rmsnorm", norm_bench), ("logprob", logprob_bench), ("entropy", entropy_bench))
    for key, call in () if args.skip_mem else mem_benches:
        _record(res, key, functools.partial(call, bw))
    res["seconds"] = time.time() - t0
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {args.out} in {res['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
