"""The grouped expert GEMM's backward (dgrad + wgrad) at Qwen3-30B-A3B expert shapes, against the stock paths.

    python tools/bench_moe_backward.py --out moe_backward.json

Rows: fc1 (K 2048 -> N 1536, gate|up) and fc2 (K 768 -> N 2048) at several token counts routed top-8 over 128
experts with a skewed popularity (``megatron_iso.bench.kernels.moe.moe_counts``). Columns, each the time of
dgrad + wgrad of one call:
- ``loop``: the per-expert library loop the trainer ran before (``reference.linear_backward`` on each expert's
  rows), counts already on the host (what it costs without its host sync);
- ``triton``: ``grouped_backward_triton`` (two launches, counts on the device);
- ``grouped_mm``: torch's grouped GEMM (``torch._grouped_mm``, stacked weights, offsets on the device), the
  stock kernel a Megatron user would reach for, where this torch has it.
Checked in the same run: each path's two calls give the same bits (deterministic), and its error against an fp32
computation of the same bf16 inputs. Times are CUDA-graph replays (median); TFLOP/s count 4 * rows * N * K.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megatron_iso.bench.kernels.moe import MOE_E, MOE_F, MOE_H, moe_counts
from megatron_iso.bench.kernels.timing import rand, time_ms
from megatron_iso.testing.bits import same_bits

SHAPES = (("fc1", MOE_H, 2 * MOE_F), ("fc2", MOE_F, MOE_H))
TOKENS = (512, 2048, 8192)
WHOLE = ("loop", "triton", "shipped", "grouped_mm")  # dgrad + wgrad; the other paths time one of the two
PATHS = (*WHOLE, "triton_dgrad", "triton_wgrad", "grouped_mm_wgrad")


def _paths(ws: list[torch.Tensor], stacked: torch.Tensor, counts: list[int]):
    from megatron_iso.ops.gemm.grouped import per_expert_backward
    from megatron_iso.ops.gemm.grouped_backward_triton import grouped_linear_backward_triton

    counts_dev = torch.tensor(counts, device="cuda")
    offs = counts_dev.to(torch.int32).cumsum(0, dtype=torch.int32)

    def loop(g, x):
        gx, gws = per_expert_backward(g, x, ws, counts)
        return gx, torch.stack(gws)

    def triton_path(g, x):
        return grouped_linear_backward_triton(g, x, ws, counts_dev)

    def grouped_mm(g, x):
        g16 = g.to(x.dtype)
        gx = torch._grouped_mm(g16, stacked, offs=offs)
        gw = torch._grouped_mm(g16.t(), x, offs=offs)
        return gx, gw

    def part(need_x, wgrad):
        return lambda g, x: grouped_linear_backward_triton(
            g, x, ws, counts_dev, need_x=need_x, need_w=not need_x, wgrad=wgrad
        )

    return {
        "loop": loop,
        "triton": lambda g, x: grouped_linear_backward_triton(g, x, ws, counts_dev, wgrad="triton"),
        "shipped": triton_path,  # the trainer's choice here (wgrad_backend): Triton dgrad, grouped_mm wgrad on sm90+
        "grouped_mm": grouped_mm,
        "triton_dgrad": part(True, "triton"),
        "triton_wgrad": part(False, "triton"),
        "grouped_mm_wgrad": part(False, "grouped_mm"),
    }


def bench(tokens_list=TOKENS) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    dt = torch.bfloat16
    for name, k, n in SHAPES:
        ws = [rand((n, k), dt, 1000 + e) / k**0.5 for e in range(MOE_E)]
        stacked = torch.stack(ws)
        for tokens in tokens_list:
            counts = moe_counts(tokens)
            t = sum(counts)
            x = rand((t, k), dt, 2000 + tokens)
            g = rand((t, n), torch.float32, 3000 + tokens)
            g16 = g.to(dt).float()
            ref_x = torch.cat([g16[s : s + c] @ ws[e].float() for e, (s, c) in enumerate(_spans(counts))])
            ref_w = torch.stack([g16[s : s + c].t() @ x[s : s + c].float() for s, c in _spans(counts)])
            row: dict[str, Any] = {"gemm": name, "tokens": tokens, "rows": t, "N": n, "K": k, "max_rows": max(counts)}
            for key, fn in _paths(ws, stacked, counts).items():
                try:
                    gx, gw = fn(g, x)
                    gx2, gw2 = fn(g, x)
                    row[f"{key}_deterministic"] = all(
                        a is None or same_bits(a, b) for a, b in ((gx, gx2), (gw, gw2))
                    )  # fmt: skip
                    if gx is not None:
                        row[f"{key}_rel_err_x"] = float((gx.float() - ref_x).norm() / ref_x.norm())
                    if gw is not None:
                        row[f"{key}_rel_err_w"] = float((gw.float() - ref_w).norm() / ref_w.norm())
                    ms = time_ms(lambda fn=fn, g=g, x=x: fn(g, x))
                    row[f"{key}_ms"] = ms
                    row[f"{key}_tflops"] = (4 if key in WHOLE else 2) * t * n * k / ms / 1e9
                except Exception as exc:  # a torch without _grouped_mm, or a shape it refuses: a result too
                    row[f"{key}_error"] = repr(exc)[:300]
            rows.append(row)
            cells = " | ".join(
                f"{key} {row[f'{key}_ms'] * 1e3:8.1f} us ({row[f'{key}_tflops']:4.0f} TF/s, det={row[f'{key}_deterministic']})"
                if f"{key}_ms" in row
                else f"{key} ERROR"
                for key in PATHS
            )
            print(f"{name} T={tokens:>5} rows={t:>6}: {cells}", flush=True)
        del ws, stacked
        torch.cuda.empty_cache()
    return rows


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for c in counts:
        out.append((start, c))
        start += c
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    ap.add_argument("--out", type=Path, default=Path("moe_backward.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_backward needs a CUDA device", file=sys.stderr)
        return 2
    from megatron_iso.bench.provenance import code_identity

    t0 = time.time()
    rows = bench(tuple(int(t) for t in args.tokens.split(",")))
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), **code_identity(), "rows": rows, "seconds": time.time() - t0}  # fmt: skip
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out} in {res['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
