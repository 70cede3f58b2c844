"""``iso-gate``: accept a candidate op implementation only if it is faster AND the contract holds.

Examples::

    iso-gate --op rmsnorm --candidate my_kernels.norm:rms_norm_fast
    iso-gate --op gemm --candidate gemm.native@1 profile=correctness          # a bit-different candidate
    iso-gate --op gemm --candidate my_kernels.gemm:linear --new-policy --candidate-id my_gemm@2 \
        --write-lock iso.lock.json

Trailing arguments are Hydra overrides selecting the incumbent (profile, device). Exit codes:
0 pass; 1 not faster; 2 lock mismatch / outputs differ (an undeclared numerical policy change);
3 bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iso-gate", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. profile=correctness device=cpu")
    p.add_argument("--op", required=True, help="op family in the registry, e.g. gemm, rmsnorm, swiglu")
    p.add_argument("--candidate", required=True, help="package.module:function, package.module:OPIMPL or id@version")
    p.add_argument("--lock", default=None, help="lockfile to verify against (default: a fresh lock of the incumbent)")
    p.add_argument("--new-policy", action="store_true", help="declare a numerical change as a new policy")
    p.add_argument("--candidate-id", default=None, help="impl_id@version of the candidate under --new-policy")
    p.add_argument("--write-lock", default=None, help="with --new-policy: write the new policy's lockfile here")
    p.add_argument("--min-speedup", type=float, default=1.05, help="median(incumbent)/median(candidate) required")
    p.add_argument("--runs", type=int, default=15, help="timed calls per implementation (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inputs", default=None, help="module:function returning (args, kwargs) for the benchmark")
    p.add_argument("--ops", action="append", default=None, metavar="PACKAGE", help="op packages to import")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``iso-gate``; returns the exit code."""
    from megatron_iso.bench.gate import EXIT_BAD_INPUT, GateInputError, run_gate
    from megatron_iso.contract import ContractValidationError, LockfileError

    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if any(e.startswith("-") for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        result = run_gate(
            args.op,
            args.candidate,
            overrides=[*args.overrides, *extra],
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
    except (GateInputError, LockfileError, ContractValidationError) as exc:
        print(f"iso-gate: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # Hydra override errors carry their own clear message
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"iso-gate: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    for line in result.lines():
        print(line)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
