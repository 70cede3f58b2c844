"""``iso-gate``: accept a candidate op implementation only if it is faster AND the contract holds.

Examples::

    iso-gate --op rmsnorm --candidate my_kernels.norm:rms_norm_fast
    iso-gate --op gemm --candidate gemm.native@1 profile=correctness          # a bit-different candidate
    iso-gate --op gemm --candidate my_kernels.gemm:linear --new-policy --candidate-id my_gemm@2 \\
        --write-lock iso.lock.json

Trailing arguments are Hydra overrides selecting the incumbent (profile, device).

Exit codes (``megatron_iso.cli.exit_codes``, plus two of the gate's own):
0 pass (faster, and the numbers hold or are declared a new policy);
1 refused: not faster (the numbers hold; the speedup is below --min-speedup);
2 usage error: a bad option, override, op, candidate or lockfile (one line on stderr, nothing run or written);
3 does not occur (a NaN in the candidate's output is a difference: 5); 4 internal failure of the gate (traceback);
5 refused: the numbers moved (lock mismatch or benchmark outputs differ: an undeclared numerical policy
change); checked before speed, so a candidate both slower and different gets 5;
6 the candidate (or the --inputs function) raised: its traceback, then one line naming it.
--debug (or HYDRA_FULL_ERROR=1) re-raises every error with its traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from megatron_iso.cli.arg_types import finite_float, int_at_least, new_file
from megatron_iso.cli.exit_codes import debug_requested, one_line, run_cli

PROG = "iso-gate"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[-1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. profile=correctness device=cpu")
    p.add_argument("--op", required=True, help="op family in the registry, e.g. gemm, rmsnorm, swiglu")
    p.add_argument("--candidate", required=True, help="package.module:function, package.module:OPIMPL or id@version")
    p.add_argument("--lock", default=None, help="lockfile to verify against (default: a fresh lock of the incumbent)")
    p.add_argument("--new-policy", action="store_true", help="declare a numerical change as a new policy")
    p.add_argument("--candidate-id", default=None, help="with --new-policy: impl_id@version of the candidate")
    p.add_argument("--write-lock", type=new_file, default=None, help="with --new-policy: write the new lockfile here")
    p.add_argument(
        "--min-speedup",
        type=finite_float(0, allow_low=False),
        default=1.05,
        help="median(incumbent)/median(candidate) required (a finite number > 0)",
    )
    p.add_argument("--runs", type=int_at_least(1), default=15, help="timed calls per implementation (median)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed calls before them")
    p.add_argument("--inputs", default=None, help="module:function returning (args, kwargs) for the benchmark")
    p.add_argument("--ops", action="append", default=None, metavar="PACKAGE", help="op packages to import")
    p.add_argument("--debug", action="store_true", help="re-raise errors with their traceback")
    return p


def _gate(args: argparse.Namespace, overrides: list[str]) -> int:
    from megatron_iso.bench.gate import EXIT_CANDIDATE_FAILED, CandidateError, run_gate

    try:
        result = run_gate(
            args.op,
            args.candidate,
            overrides=overrides,
            lock=args.lock,
            new_policy=args.new_policy,
            candidate_id=args.candidate_id,
            write_lock_to=args.write_lock,
            min_speedup=args.min_speedup,
            runs=args.runs,
            warmup=args.warmup,
            inputs=args.inputs,
            ops_packages=args.ops,
        )
    except CandidateError as exc:
        if debug_requested(args.debug):
            raise
        traceback.print_exception(exc.__cause__ or exc)
        print(f"{PROG}: candidate failed: {one_line(exc)}", file=sys.stderr)
        return EXIT_CANDIDATE_FAILED
    for line in result.lines():
        print(line)
    return result.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``iso-gate``; returns the exit code."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if any(e.startswith("-") for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    for flag, value in (("--write-lock", args.write_lock), ("--candidate-id", args.candidate_id)):
        if value is not None and not args.new_policy:
            parser.error(f"{flag} applies to a declared new policy only; add --new-policy or drop {flag}")
    return run_cli(PROG, lambda: _gate(args, [*args.overrides, *extra]), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
