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

import hydra
from omegaconf import DictConfig

from megatron_iso.cli.exit_codes import EXIT_OK, run_cli
from megatron_iso.config import conf_dir, load_config

PROG = "iso-train"


def _train(cfg: DictConfig) -> int:
    from megatron_iso.rl.loop import train

    summary = train(cfg)
    last = summary["history"][-1] if summary["history"] else {}
    keys = ("reward/mean", "mismatch/abs_diff_max", "mismatch/abs_diff_mean", "loss")
    print({k: last.get(k) for k in keys} | {"run_dir": summary["run_dir"], "dashboard": summary["dashboard"]})
    return EXIT_OK


def _compose(overrides: list[str]) -> int:
    load_config(overrides)
    return EXIT_OK


def _run(cfg: DictConfig) -> None:
    code = run_cli(PROG, lambda: _train(cfg))
    if code != EXIT_OK:
        sys.exit(code)


def main() -> None:
    args = sys.argv[1:]
    if not any(a.startswith("-") for a in args):
        # Plain overrides: compose them first, so that a bad one is a one-line usage error, not Hydra's report.
        code = run_cli(PROG, lambda: _compose(args))
        if code != EXIT_OK:
            sys.exit(code)
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_run)()


if __name__ == "__main__":
    main()
