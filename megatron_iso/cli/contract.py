"""``iso-contract``: show, digest, diff, lock and verify Execution Contracts.

Every subcommand takes Hydra overrides (``model=... profile=... parallel.tp=...``) as trailing
arguments. Exit codes (``megatron_iso.cli.exit_codes``): 0 ok; 1 contracts differ / probes diverged; 2 bad
input (invalid config, unreadable or tampered file), one line on stderr; 4 internal failure (traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_iso.cli.exit_codes import EXIT_NO as EXIT_DIFFERS
from megatron_iso.cli.exit_codes import EXIT_OK, EXIT_USAGE, one_line, run_cli


def _contract(args: argparse.Namespace, overrides: Sequence[str] | None = None) -> Any:
    """The contract of the overrides, built as the trainer builds it (``settings.contract_for``); ``--ops``
    names the implementation packages instead of the project's own."""
    from megatron_iso.settings import contract_for
    from megatron_iso.settings.compose import load_config

    if args.ops:
        _load_ops(args.ops)
    cfg = load_config(args.overrides if overrides is None else overrides)
    return contract_for(cfg, load_implementations=not args.ops)


def _load_ops(packages: Sequence[str]) -> None:
    """``--ops``: import the named implementation packages; one that is not importable is a usage error naming it
    (an import error inside an existing package stays a traceback: that is the package's bug)."""
    from megatron_iso.contract import load_op_implementations
    from megatron_iso.errors import UserError

    try:
        load_op_implementations(packages=packages)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if not any(top == p.split(".")[0] for p in packages):
            raise
        raise UserError(
            f"--ops {' '.join(packages)}: no module named {exc.name!r}; allowed values: importable packages of "
            "implementations, e.g. megatron_iso.ops megatron_iso.parallel"
        ) from None


def _load_contract_file(path: str) -> dict[str, Any]:
    """A contract from a contract JSON, a lockfile (its ``contract``) or a handshake file."""
    from megatron_iso.contract import Contract, read_lock

    raw = json.loads(Path(path).read_text(encoding="ascii"))
    if isinstance(raw, dict) and "self_digest" in raw:
        raw = read_lock(path)["contract"]
    return Contract.from_dict(raw, source=path).to_dict()


def cmd_show(args: argparse.Namespace) -> int:
    print(json.dumps(_contract(args).to_dict(), indent=2, sort_keys=True))
    return EXIT_OK


def cmd_digest(args: argparse.Namespace) -> int:
    print(json.dumps(_contract(args).identities.to_dict(), sort_keys=True))
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    from megatron_iso.contract.handshake import contract_diffs

    a, b = _load_contract_file(args.a), _load_contract_file(args.b)
    keyed = contract_diffs(a, b)
    neutral = contract_diffs(a, b, sections=("deployment",))
    for path, x, y in keyed + neutral:
        print(f"{path}: {json.dumps(x)} != {json.dumps(y)}")
    if keyed:
        policy = any(p.startswith("numerical_policy") for p, _, _ in keyed)
        print(
            f"{'numerical_policy' if policy else 'semantic'} differs: these contracts must not be paired",
            file=sys.stderr,
        )
        return EXIT_DIFFERS
    print("numerical_policy and semantic identical" + (" (deployment differs)" if neutral else ""), file=sys.stderr)
    return EXIT_OK


def cmd_lock(args: argparse.Namespace) -> int:
    from megatron_iso.contract import write_lock

    contract = _contract(args)
    lock = write_lock(args.out, contract, args.overrides)
    n = sum(len(v) for v in lock["probes"].values())
    print(f"wrote {args.out}: numerical_policy {contract.identities.numerical_policy}, {n} probe digests")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from megatron_iso.contract import read_lock, verify_lock

    # No overrides given: rebuild the contract the lock was written for.
    overrides = args.overrides or read_lock(args.lock)["overrides"]
    report = verify_lock(args.lock, _contract(args, overrides))
    for line in report.lines():
        print(line)
    if report.ok:
        print(f"{args.lock}: contract and {report.checked} probe digests match")
        return EXIT_OK
    print(f"{args.lock}: verification FAILED ({len(report.lines())} differences)", file=sys.stderr)
    return EXIT_DIFFERS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iso-contract", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. profile=performance parallel.tp=2")
        sp.add_argument(
            "--ops",
            action="append",
            default=None,
            metavar="PACKAGE",
            help="package(s) to import op implementations from instead of the project's own "
            "(megatron_iso.ops and megatron_iso.parallel); plus $ISO_OP_MODULES",
        )

    with_config(sub.add_parser("show", help="print the contract as JSON"))
    with_config(sub.add_parser("digest", help="print the three identities as one JSON object"))
    d = sub.add_parser("diff", help="differing field paths of two contract/lock files; exit 1 if the policy differs")
    d.add_argument("a")
    d.add_argument("b")
    lk = sub.add_parser("lock", help="write the contract and golden probe digests")
    lk.add_argument("--out", default="iso.lock.json")
    with_config(lk)
    v = sub.add_parser("verify", help="rerun the probes; exit 0 only if the contract and every digest match")
    v.add_argument("--lock", default="iso.lock.json")
    with_config(v)
    return p


COMMANDS = {"show": cmd_show, "digest": cmd_digest, "diff": cmd_diff, "lock": cmd_lock, "verify": cmd_verify}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``iso-contract``; returns the exit code."""
    from megatron_iso.contract import CanonicalError

    parser = _parser()
    # parse_known_args + this merge lets overrides sit on either side of options (`lock a=b --out f c=d`);
    # argparse alone stops filling a positional list once an option interrupts it.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]

    def command() -> int:
        try:
            return COMMANDS[args.command](args)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, CanonicalError) as exc:  # an unreadable input file
            print(f"iso-contract {args.command}: error: {one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE

    return run_cli(f"iso-contract {args.command}", command)


if __name__ == "__main__":
    sys.exit(main())
