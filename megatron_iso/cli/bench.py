"""``iso-bench``: the rollout-vs-trainer logprob mismatch benchmark (a Hydra app over ``conf/``).

Examples::

    iso-bench                                          # CPU grid on tiny_dense: iso rows 0, native rows > 0
    iso-bench model=tiny_moe bench.ep=[1,2] bench.batch=[1,8]
    iso-bench bench.profiles=[performance] bench.tp=[1,2,4] bench.out=runs/tp_sweep.json
    iso-bench --launcher torchrun bench.tp=[1,2]       # layouts' ranks by torchrun: one per GPU, NCCL

``--launcher gloo|torchrun`` is shorthand for the ``bench.launcher=`` override.
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


def launcher_flag(argv: list[str]) -> list[str]:
    """``argv`` with ``--launcher NAME`` / ``--launcher=NAME`` turned into the ``bench.launcher=NAME``
    override; a name outside ``megatron_iso.bench.grid.LAUNCHERS`` is refused before anything runs."""
    from megatron_iso.bench.grid import LAUNCHERS, check_launcher

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--launcher" or arg.startswith("--launcher="):
            if arg == "--launcher":
                if i + 1 >= len(argv):
                    raise SystemExit(f"iso-bench: --launcher needs a value; allowed values: {sorted(LAUNCHERS)}")
                name, i = argv[i + 1], i + 2
            else:
                name, i = arg.split("=", 1)[1], i + 1
            try:
                out.append(f"bench.launcher={check_launcher(name, '--launcher')}")
            except ValueError as exc:
                raise SystemExit(f"iso-bench: {exc}") from None
            continue
        out.append(arg)
        i += 1
    return out


def main() -> None:
    sys.argv[1:] = launcher_flag(sys.argv[1:])
    hydra.main(config_path=str(conf_dir()), config_name=CONFIG_NAME, version_base=None)(_run)()


if __name__ == "__main__":
    sys.exit(main())
