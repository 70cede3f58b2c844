"""``iso-bisect``: the first op whose output differs between two runtime configurations.

Each side is Hydra overrides plus ``case=trainer_forward|prefill_decode``; both run the same
weights and tokens, each in its own process group. Examples::

    iso-bisect --a "profile=correctness" --b "profile=performance"
    iso-bisect --a "profile=performance" --b "profile=performance case=prefill_decode"
    iso-bisect --a "parallel.tp=1" --b "parallel.tp=2 parallel.sp=true"
    iso-bisect --launcher torchrun --a "parallel.tp=1" --b "parallel.tp=2"   # ranks by torchrun (NCCL on GPUs)

Exit codes: 0 no divergence; 1 a divergence (printed: layer, op, case, max |diff|, the op's
implementation ids on both sides); 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

EXIT_SAME, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iso-bisect", description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help='side A: Hydra overrides and case=..., e.g. "profile=correctness"')
    p.add_argument("--b", required=True, help='side B, e.g. "profile=performance case=prefill_decode"')
    p.add_argument("--num-seqs", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=6, help="tokens a prefill_decode side prefills")
    p.add_argument("--total-len", type=int, default=10, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=3, help="token seed")
    p.add_argument("--weights-seed", type=int, default=7)
    p.add_argument("--json", dest="json_out", default=None, help="also write every compared op to this file")
    p.add_argument(
        "--launcher", default="gloo", help="how each side's ranks start: gloo (forked CPU ranks) or torchrun"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``iso-bisect``; returns the exit code."""
    args = _parser().parse_args(argv)
    from megatron_iso.bench.bisect import BisectInput, bisect, format_result, parse_side
    from megatron_iso.bench.grid import check_launcher

    try:
        launcher = check_launcher(args.launcher, "--launcher")
        a, b = parse_side(args.a), parse_side(args.b)
        inp = BisectInput(args.num_seqs, args.prompt_len, args.total_len, args.seed, args.weights_seed)
        inp.sequences(2)  # validate before starting any rank
        result = bisect(a, b, inp, launcher=launcher)
    except ValueError as exc:
        print(f"iso-bisect: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # Hydra override errors carry their own clear message
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"iso-bisect: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    print(format_result(result))
    if args.json_out:
        doc = {
            "a": asdict(a),
            "b": asdict(b),
            "ops": [asdict(r) for r in result.compared],
            "skipped": result.skipped,
        }
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    return EXIT_SAME if result.first_divergence is None else EXIT_DIVERGED


if __name__ == "__main__":
    sys.exit(main())
