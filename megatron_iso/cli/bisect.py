"""``iso-bisect``: the first op whose output differs between two runtime configurations.

Each side is Hydra overrides plus ``case=trainer_forward|prefill_decode``; both run the same
weights and tokens, each in its own process group. Examples::

    iso-bisect --a "profile=correctness" --b "profile=performance"
    iso-bisect --a "profile=performance" --b "profile=performance case=prefill_decode"
    iso-bisect --a "parallel.tp=1" --b "parallel.tp=2 parallel.sp=true"
    iso-bisect --launcher torchrun --a "parallel.tp=1" --b "parallel.tp=2"   # ranks by torchrun (NCCL on GPUs)

Exit codes (``megatron_iso.cli.exit_codes``): 0 no divergence; 1 a divergence (printed: layer, op, case,
max |diff|, the op's implementation ids on both sides); 2 usage error: a bad option, side or setting (e.g. a
TP that does not divide the model's heads), one line on stderr naming it, checked before any rank starts;
4 internal failure (traceback). NaNs are compared by their bits like any output (3 is not used). --debug
(or HYDRA_FULL_ERROR=1) re-raises every error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from megatron_iso.cli.arg_types import new_file
from megatron_iso.cli.exit_codes import EXIT_NO, EXIT_OK, EXIT_USAGE, run_cli

if TYPE_CHECKING:
    from megatron_iso.bench.bisect import Side

PROG = "iso-bisect"
EXIT_SAME, EXIT_DIVERGED, EXIT_BAD_INPUT = EXIT_OK, EXIT_NO, EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[-1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--a", required=True, help='side A: Hydra overrides and case=..., e.g. "profile=correctness"')
    p.add_argument("--b", required=True, help='side B, e.g. "profile=performance case=prefill_decode"')
    p.add_argument("--num-seqs", type=int, default=2, help="sequences per side (>= 1)")
    p.add_argument("--prompt-len", type=int, default=6, help="tokens a prefill_decode side prefills (>= 2)")
    p.add_argument("--total-len", type=int, default=10, help="tokens per sequence (>= --prompt-len)")
    p.add_argument("--seed", type=int, default=3, help="token seed")
    p.add_argument("--weights-seed", type=int, default=7)
    p.add_argument("--json", dest="json_out", type=new_file, default=None, help="also write every compared op here")
    p.add_argument(
        "--launcher", default="gloo", help="how each side's ranks start: gloo (forked CPU ranks) or torchrun"
    )
    p.add_argument("--debug", action="store_true", help="re-raise errors with their traceback")
    return p


def _side(flag: str, spec: str) -> Side:
    from megatron_iso.bench.bisect import BisectInputError, parse_side

    try:
        return parse_side(spec)
    except BisectInputError as exc:
        raise BisectInputError(f"{flag} {spec!r}: {exc}") from None
    except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
        raise BisectInputError(
            f"{flag} {spec!r}: {exc}; allowed values: overrides as a shell would split them (close every quote)"
        ) from None


def _bisect(args: argparse.Namespace) -> int:
    from megatron_iso.bench.bisect import BisectInput, BisectInputError, bisect, format_result
    from megatron_iso.bench.grid import check_launcher

    try:
        launcher = check_launcher(args.launcher, "--launcher")
    except ValueError as exc:
        raise BisectInputError(str(exc)) from None
    for flag, value, low in (("--num-seqs", args.num_seqs, 1), ("--prompt-len", args.prompt_len, 2)):
        if value < low:
            raise BisectInputError(f"{flag}={value} is not allowed; allowed values: integers >= {low}")
    if args.prompt_len > args.total_len:
        raise BisectInputError(
            f"--total-len={args.total_len} is not allowed; allowed values: integers >= --prompt-len={args.prompt_len}"
        )
    inp = BisectInput(args.num_seqs, args.prompt_len, args.total_len, args.seed, args.weights_seed)
    a, b = (_side(flag, spec) for flag, spec in (("--a", args.a), ("--b", args.b)))
    result = bisect(a, b, inp, launcher=launcher)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``iso-bisect``; returns the exit code."""
    args = _parser().parse_args(argv)
    return run_cli(PROG, lambda: _bisect(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
