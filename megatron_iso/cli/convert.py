"""``iso-convert``: HF safetensors directory <-> megatron_iso checkpoint, and a logits check
against HF transformers.

  iso-convert import  --hf DIR --out DIR [--tp N] [--ep M] [overrides...]
  iso-convert export  --ckpt DIR --out DIR [--max-shard-size BYTES]
  iso-convert compare --hf DIR [--tokens 1,2,3] [--seed S] [--length L] [--max-rel TOL] [overrides...]

Overrides are Hydra's (``profile=performance model.params_dtype=bf16``).

Exit codes (``megatron_iso.cli.exit_codes``): 0 ok; 1 compare: the logits differ by more than --max-rel
or are not finite; 2 usage error: a bad option or override, an unsupported config, a missing directory, a
missing, truncated or corrupted file (a run checkpoint's: a SHA-256 other than the recorded one), a missing or
misshapen tensor, an --out that is the source, lies inside it or inside a training run's directory (one line on
stderr naming it; no output is left: it is built in a temporary sibling and renamed into place when complete);
4 internal failure (traceback). --debug (or HYDRA_FULL_ERROR=1) re-raises every error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from megatron_iso.cli.arg_types import finite_float, int_at_least, int_list
from megatron_iso.cli.exit_codes import EXIT_NO, EXIT_OK, EXIT_USAGE, debug_requested, one_line, run_cli

EXIT_DIFFERS, EXIT_BAD_INPUT = EXIT_NO, EXIT_USAGE
# How the conversion functions (and the model/config readers under them) report a bad input: a missing file,
# an unreadable one, a tensor missing (KeyError) or of the wrong shape (ValueError). At this boundary they
# are the user's to fix; UserErrors (an unsupported config, a damaged file) are usage errors anyway.
INPUT_ERRORS = (KeyError, ValueError, OSError)


def cmd_import(args: argparse.Namespace) -> int:
    from megatron_iso.checkpoint import import_hf

    manifest = import_hf(args.hf, args.out, tp=args.tp, overrides=args.overrides, ep=args.ep)
    files = ", ".join(f["file"] for f in manifest["files"])
    layout = manifest["layout"]
    print(f"wrote {args.out}: model {manifest['model']['name']} TP={layout['tp']} EP={layout['ep']} ({files})")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from megatron_iso.checkpoint import export_hf

    files = export_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_size)
    print(f"wrote {args.out}: config.json, {', '.join(files)}")
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from megatron_iso.checkpoint.compare import compare_with_transformers

    result = compare_with_transformers(args.hf, args.overrides, tokens=args.tokens, seed=args.seed, length=args.length)
    if args.max_rel is not None:
        result["max_rel_tolerance"] = args.max_rel
        result["within_tolerance"] = result["finite"] and result["max_rel_diff"] <= args.max_rel
    print(json.dumps(result, sort_keys=True, allow_nan=False))
    if not result["finite"]:
        print("iso-convert compare: NaN or Inf in the logits: the checkpoints do not match", file=sys.stderr)
    return EXIT_DIFFERS if result.get("within_tolerance") is False or not result["finite"] else EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="iso-convert",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[-1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="re-raise errors with their traceback")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF safetensors directory -> megatron_iso checkpoint at a TP/EP layout")
    imp.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    imp.add_argument("--out", required=True, help="checkpoint directory to write")
    imp.add_argument("--tp", type=int_at_least(1), default=None, help="TP layout to write (default: parallel.tp)")
    imp.add_argument(
        "--ep", type=int_at_least(1), default=None, help="EP layout of a MoE model's experts (default: parallel.ep)"
    )
    exp = sub.add_parser("export", help="megatron_iso checkpoint (any TP/EP layout) -> HF safetensors directory")
    exp.add_argument("--ckpt", required=True, help="iso-convert import's checkpoint, or a run's checkpoints/step_N")
    exp.add_argument("--out", required=True, help="HF directory to write (not the source, nor in a run directory)")
    exp.add_argument(
        "--max-shard-size", type=int_at_least(1), default=None, metavar="BYTES", help="split weights into shards"
    )
    cmp_ = sub.add_parser("compare", help="fp32 logits of megatron_iso vs HF transformers as one JSON object")
    cmp_.add_argument("--hf", required=True)
    cmp_.add_argument("--tokens", type=int_list, default=None, help="comma-separated token ids (default: random)")
    cmp_.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    cmp_.add_argument("--length", type=int_at_least(1), default=16, help="number of random token ids")
    cmp_.add_argument(
        "--max-rel", type=finite_float(0, allow_low=True), default=None, help="exit 1 if max_rel_diff exceeds this"
    )
    for sp in (imp, exp, cmp_):
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for sp in (imp, cmp_):
        sp.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. profile=performance")
    return p


COMMANDS = {"import": cmd_import, "export": cmd_export, "compare": cmd_compare}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``iso-convert``; returns the exit code."""
    parser = _parser()
    # Overrides may sit on either side of options; argparse alone stops the positional list at an option.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    prog = f"iso-convert {args.command}"

    def command() -> int:
        try:
            return COMMANDS[args.command](args)
        except INPUT_ERRORS as exc:
            if debug_requested(args.debug):
                raise
            # KeyError's str() adds quotes around its message: print the message itself.
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            print(f"{prog}: error: {one_line(Exception(message))}", file=sys.stderr)
            return EXIT_BAD_INPUT

    return run_cli(prog, command, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
