"""``iso-train``: the RL loop as a Hydra app over ``conf/`` (run directly or under torchrun).

Examples::

    iso-train                                  # GRPO on tiny_dense, CPU, correctness profile
    iso-train profile=performance rl.steps=20  # the same run with stock kernels: watch mismatch/*
    torchrun --nproc-per-node 2 -m megatron_iso.cli.train parallel.tp=2 parallel.sp=true

Exit codes (``megatron_iso.cli.exit_codes``): 0 the run finished; 2 a bad setting or a run directory that
cannot be used as asked (one line on stderr); 3 the run stopped on a NaN or Inf; 4 an internal failure
(traceback). ``HYDRA_FULL_ERROR=1`` shows the traceback of every error.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from megatron_iso.cli.exit_codes import EXIT_OK, run_cli
from megatron_iso.settings import Settings, check_overrides, check_trainable, resolve
from megatron_iso.settings.compose import conf_dir, load_config

PROG = "iso-train"


SUMMARY_KEYS = ("reward/mean", "mismatch/abs_diff_max", "mismatch/abs_diff_mean", "loss")


def _last_logged(run_dir: Path) -> dict[str, Any]:
    """The last row of ``metrics.jsonl`` holding a training metric (a torn last line skipped); {} if none."""
    path = run_dir / "metrics.jsonl"
    rows = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []
    for line in reversed(rows):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and any(k in row for k in SUMMARY_KEYS):
            return row
    return {}


def validate(overrides: Sequence[str]) -> Settings:
    """Compose and check a command line's overrides as iso-train does before any rank starts: unknown keys
    (``settings.schema``), then the typed settings and every check of a config and of this machine
    (``settings.check_trainable``), with ``model.init_from``'s model in place. A bad value raises a UserError
    (exit 2, one line); the hostile-input table (tests/cli/hostile_inputs.yaml) runs through this function."""
    from megatron_iso.checkpoint.init_from import apply_init_from

    check_overrides(overrides)
    cfg = apply_init_from(load_config(overrides), overrides)
    settings = resolve(cfg)
    check_trainable(settings)
    return settings


def _train(cfg: DictConfig) -> int:
    from megatron_iso.rl.run import train

    summary = train(cfg)
    if os.environ.get("RANK", "0") != "0":  # one summary per run: torchrun's other ranks print none
        return EXIT_OK
    if "finished_at" in summary:
        step = summary["finished_at"]
        last = _last_logged(Path(summary["run_dir"]))
        print(
            f"{PROG}: out_dir={summary['run_dir']} already finished at step {step} (rl.steps={cfg.rl.steps}): nothing "
            f"to run; rl.steps counts every step of the run, so to train further raise it (e.g. "
            f"rl.steps={2 * (step + 1)} resume=true)",
            file=sys.stderr,
        )
        metrics = {k: last[k] for k in SUMMARY_KEYS if k in last}
        print(
            json.dumps({"step": last.get("step"), **metrics, "run_dir": str(summary["run_dir"])}) if metrics else "{}"
        )
        return EXIT_OK
    last = summary["history"][-1] if summary["history"] else {}
    # The run's last metrics as one JSON line on stdout (scripts read it; the progress went to stderr).
    final = {"step": summary.get("last_step")} | {k: last.get(k) for k in SUMMARY_KEYS}
    print(json.dumps(final | {"run_dir": str(summary["run_dir"]), "dashboard": str(summary["dashboard"])}))
    return EXIT_OK


def _validate(overrides: list[str]) -> int:
    validate(overrides)
    return EXIT_OK


def _run(cfg: DictConfig) -> None:
    code = run_cli(PROG, lambda: _train(cfg))
    if code != EXIT_OK:
        sys.exit(code)


def main() -> None:
    args = sys.argv[1:]
    if not any(a.startswith("-") for a in args):
        # Plain overrides: compose and check them first, so that a bad one is a one-line usage error (not Hydra's
        # report, nor a rank's traceback), before anything starts.
        code = run_cli(PROG, lambda: _validate(args))
        if code != EXIT_OK:
            sys.exit(code)
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_run)()


if __name__ == "__main__":
    main()
