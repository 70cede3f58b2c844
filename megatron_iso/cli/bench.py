"""``iso-bench``: the rollout-vs-trainer logprob mismatch benchmark (a Hydra app over ``conf/``).

Examples::

    iso-bench                                          # CPU grid on tiny_dense: iso rows 0, native rows > 0
    iso-bench model=tiny_moe bench.ep=[1,2] bench.batch=[1,8]
    iso-bench bench.profiles=[performance] bench.tp=[1,2,4] bench.out=runs/tp_sweep.json
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from megatron_iso.config import conf_dir

CONFIG_NAME = "iso_bench"


def _run(cfg: DictConfig) -> None:
    from megatron_iso.bench.run import run_bench

    run_bench(cfg)


def main() -> None:
    hydra.main(config_path=str(conf_dir()), config_name=CONFIG_NAME, version_base=None)(_run)()


if __name__ == "__main__":
    sys.exit(main())
