"""``iso-train``: the RL loop as a Hydra app over ``conf/`` (run directly or under torchrun).

Examples::

    iso-train                                  # GRPO on tiny_dense, CPU, correctness profile
    iso-train profile=performance rl.steps=20  # the same run with stock kernels: watch mismatch/*
    torchrun --nproc-per-node 2 -m megatron_iso.cli.train parallel.tp=2 parallel.sp=true
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from megatron_iso.config import conf_dir


def _run(cfg: DictConfig) -> None:
    from megatron_iso.rl.loop import train

    summary = train(cfg)
    last = summary["history"][-1] if summary["history"] else {}
    keys = ("reward/mean", "mismatch/abs_diff_max", "mismatch/abs_diff_mean", "loss")
    print({k: last.get(k) for k in keys} | {"run_dir": summary["run_dir"], "dashboard": summary["dashboard"]})


def main() -> None:
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_run)()


if __name__ == "__main__":
    sys.exit(main())
