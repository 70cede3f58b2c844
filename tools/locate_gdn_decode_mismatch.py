"""Where does a GDN decode step leave the training bits? For each prefix length L, one decode step after a prefill of L
tokens is compared, bit for bit, with a prefill of L + 1 tokens and with the training forward over the whole
sequence: the token's output row, and in the chunk form the state cache rows the step wrote (u, Y, the diagonal
block of T^{-1}) or, when the step closes its chunk, the entry state. The first step and quantity that differ say
which kernel line to read (an fp contraction in one device call shows this way: Y differs from the second
chunk on, at t = 0, where only ``beta v - (beta e^G k) E`` enters it).

    python tools/locate_gdn_decode_mismatch.py --form chunk --dot-precision bf16 --chunk 64 --dim 128 --out m.json
    python tools/locate_gdn_decode_mismatch.py --device cpu --chunk 4 --dim 8     # the kernels under the interpreter

Prints a line per differing step (the first few) and a summary; writes every step's row as JSON (--out). Exit code
0 when every compared quantity has the same bits, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from megatron_iso.testing.bits import same_bits  # torch only: no triton before TRITON_INTERPRET is set


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--form", default="chunk", choices=("chunk", "scan"))
    ap.add_argument("--dot-precision", default=None, help="gated_delta_rule's dot_precision (default: the form's)")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--dim", type=int, default=32, help="Dk = Dv")
    ap.add_argument("--heads", type=int, nargs=2, default=(2, 4), metavar=("HK", "HV"))
    ap.add_argument("--steps", type=int, default=None, help="prefix lengths 1..STEPS (default 2 * chunk + 2)")
    ap.add_argument("--seed", type=int, default=62)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the Triton interpreter")
    ap.add_argument("--show", type=int, default=8, help="differing steps printed")
    ap.add_argument("--out", type=Path, help="JSON: every step's comparison and the summary")
    args = ap.parse_args(argv)
    for name in ("chunk", "dim", "seed", "show"):
        if getattr(args, name) < (0 if name in ("seed", "show") else 1):
            ap.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    return args


def locate(x: tuple[torch.Tensor, ...], chunk: int, form: str, dot_precision: str | None, steps: int) -> list[dict]:
    """One row per prefix length L in 1..steps: which quantities of ``prefill(L) + decode(1)`` have the bits of
    ``prefill(L + 1)`` (cache rows, entry state) and of the training forward (the output row)."""
    from megatron_iso.ops.gdn import GDNLayerState
    from megatron_iso.ops.gdn.triton import rule as gt
    from megatron_iso.ops.gdn.triton import tuning as gc

    q, k, v = x[0], x[1], x[2]
    hk, hv, dk, dv, dev = k.shape[1], v.shape[1], k.shape[2], v.shape[2], q.device
    prec = gc.form_dot_precision(form, dot_precision)
    kw = {"dot_precision": prec, "form": form}
    ib = gc.config_for(dk, dv, chunk, prec, form).inv_block

    def cu(n: int) -> torch.Tensor:
        return torch.tensor([0, n], device=dev)

    def run(pieces: list[int]) -> tuple[torch.Tensor, GDNLayerState]:
        st = GDNLayerState.allocate(2, conv_dim=1, conv_kernel=2, key_heads=hk, value_heads=hv, key_dim=dk,
                                    value_dim=dv, chunk=chunk, dtype=torch.float32, device=dev, form=form,
                                    u_dtype=gc.state_u_dtype(form, prec))  # fmt: skip
        outs, pos = [], 0
        for n in pieces:
            r = slice(pos, pos + n)
            outs.append(gt.gated_delta_rule(*(t[r] for t in x), cu(n), chunk=chunk, state=st,
                                            slots=torch.tensor([1], device=dev),
                                            starts=torch.tensor([pos], device=dev), **kw))  # fmt: skip
            pos += n
        return torch.cat(outs), st

    full = gt.gated_delta_rule(*x, cu(x[0].shape[0]), chunk=chunk, **kw)
    rows = []
    for length in range(1, steps + 1):
        dec, sd = run([length, 1])
        _, so = run([length + 1])
        n = (length + 1) % chunk  # rows of the open chunk after the step (0: the step closed it)
        row: dict = {"L": length, "t": length % chunk, "output": same_bits(dec[length], full[length])}
        if form == "scan":
            row["running_state"] = same_bits(sd.running[1], so.running[1])
        elif n == 0:
            row["entry_state"] = same_bits(sd.entry[1], so.entry[1])
        else:
            row["u_rows"] = same_bits(sd.buf_u[1, :n], so.buf_u[1, :n])
            row["y_rows"] = same_bits(sd.buf_y[1, :n], so.buf_y[1, :n])
            # a decode step writes only the diagonal block of its T^{-1} row (the substitution reads no other)
            row["tinv_diag_rows"] = all(
                same_bits(
                    sd.buf_tinv[1, :, r, r // ib * ib : r // ib * ib + ib],
                    so.buf_tinv[1, :, r, r // ib * ib : r // ib * ib + ib],
                )
                for r in range(n)
            )
        row["same"] = all(v for key, v in row.items() if key not in ("L", "t"))
        rows.append(row)
    return rows


def _differing(row: dict) -> list[str]:
    return [k for k, v in row.items() if v is False and k != "same"]


def summarize(rows: list[dict]) -> dict:
    bad = [r for r in rows if not r["same"]]
    first = bad[0] if bad else None
    return {
        "steps": len(rows),
        "differing_steps": len(bad),
        "first": None if first is None else {"L": first["L"], "t": first["t"], "differs": _differing(first)},
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

        allow_runtime_loop_bounds()
    elif not torch.cuda.is_available():
        print("locate_gdn_decode_mismatch: no CUDA device (--device cpu runs the interpreter)", file=sys.stderr)
        return 2
    from megatron_iso.testing.gdn_inputs import random_gdn_inputs

    steps = args.steps or 2 * args.chunk + 2
    hk, hv = args.heads
    x = random_gdn_inputs(steps + 1, args.seed, hk=hk, hv=hv, dk=args.dim, dv=args.dim, device=args.device)
    rows = locate(x, args.chunk, args.form, args.dot_precision, steps)
    for r in [r for r in rows if not r["same"]][: args.show]:
        print(f"L={r['L']:4d} t={r['t']:3d} differs: " + ", ".join(_differing(r)))
    summary = summarize(rows)
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                        "rows": rows}, indent=1))  # fmt: skip
    return 0 if summary["differing_steps"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
