"""``iso-train``: the RL loop as a Hydra app over ``megatron_iso/conf/`` (run directly or under torchrun).

Examples::

    iso-train                                  # GRPO on tiny_dense, CPU, correctness profile
    iso-train profile=performance rl.steps=20  # the same run with stock kernels: watch mismatch/*
    torchrun --nproc-per-node 2 -m megatron_iso.cli.train parallel.tp=2 parallel.sp=true

Exit codes (``megatron_iso.cli.exit_codes``): 0 the run finished; 2 a bad setting or a run directory that
cannot be used as asked (one line on stderr); 3 the run stopped on a NaN or Inf; 4 an internal failure
(traceback). ``HYDRA_FULL_ERROR=1`` shows the traceback of every error.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

from megatron_iso.cli.exit_codes import EXIT_OK, run_cli
from megatron_iso.config import conf_dir, load_config
from megatron_iso.settings import Settings, check_overrides, check_trainable, resolve

PROG = "iso-train"


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
    from megatron_iso.rl.loop import train

    summary = train(cfg)
    last = summary["history"][-1] if summary["history"] else {}
    keys = ("reward/mean", "mismatch/abs_diff_max", "mismatch/abs_diff_mean", "loss")
    print({k: last.get(k) for k in keys} | {"run_dir": summary["run_dir"], "dashboard": summary["dashboard"]})
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
