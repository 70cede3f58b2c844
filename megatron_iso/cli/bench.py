"""``iso-bench``: the rollout-vs-trainer logprob mismatch benchmark (a Hydra app over ``conf/``).

Examples::

    iso-bench                                          # CPU grid on tiny_dense: iso rows 0, native rows > 0
                                                       # (report: runs/bench-<UTC time>-<id>/bench.json)
    iso-bench model=tiny_moe bench.ep=[1,2] bench.batch=[1,8]
    iso-bench bench.profiles=[performance] bench.tp=[1,2,4] bench.out=runs/tp_sweep.json
    iso-bench --launcher torchrun bench.tp=[1,2]       # layouts' ranks by torchrun: one per GPU, NCCL
    iso-bench study                                    # both profiles trained side by side: study.md/json/png
    iso-bench study model=tiny_moe bench.study.steps=8 out_dir=runs/study_moe

``--launcher gloo|torchrun`` is shorthand for the ``bench.launcher=`` override. ``iso-bench study``
(:mod:`megatron_iso.bench.study`) takes the same overrides (``bench.study.*`` its own, the rest passed to both
runs) and ``--help``.

Exit codes (``megatron_iso.cli.exit_codes``): 0 the grid ran and its report was written; 2 usage error: a bad
flag, override or ``bench.*`` setting, or a grid layout the model cannot run (e.g. a TP that does not divide
its heads), one line on stderr, checked before any rank starts and before anything is written; 4 internal
failure (traceback). ``--debug`` (or ``HYDRA_FULL_ERROR=1``) shows every traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from megatron_iso.cli.exit_codes import EXIT_OK, run_cli
from megatron_iso.errors import UserError
from megatron_iso.settings.compose import conf_dir, load_config
from megatron_iso.settings.fields import check_temperature
from megatron_iso.settings.resources import check_writable_dir
from megatron_iso.settings.schema import check_overrides

PROG = "iso-bench"
CONFIG_NAME = "iso_bench"


class BenchSettingsError(UserError, ValueError):
    """A flag or ``bench.*`` setting iso-bench cannot run; the message names it and its allowed values."""


def _run(cfg: DictConfig) -> None:
    from megatron_iso.bench.run import run_bench

    def bench() -> int:
        run_bench(cfg)
        return EXIT_OK

    code = run_cli(PROG, bench)
    if code != EXIT_OK:
        sys.exit(code)


def launcher_flag(argv: list[str]) -> list[str]:
    """``argv`` with ``--launcher NAME`` / ``--launcher=NAME`` turned into the ``bench.launcher=NAME``
    override; a name outside ``megatron_iso.bench.grid.LAUNCHERS`` is a :class:`BenchSettingsError`."""
    from megatron_iso.bench.grid import LAUNCHERS, check_launcher

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--launcher" or arg.startswith("--launcher="):
            if arg == "--launcher":
                if i + 1 >= len(argv):
                    raise BenchSettingsError(f"--launcher needs a value; allowed values: {sorted(LAUNCHERS)}")
                name, i = argv[i + 1], i + 2
            else:
                name, i = arg.split("=", 1)[1], i + 1
            try:
                out.append(f"bench.launcher={check_launcher(name, '--launcher')}")
            except ValueError as exc:
                raise BenchSettingsError(str(exc)) from None
            continue
        out.append(arg)
        i += 1
    return out


def _refuse(key: str, value: Any, allowed: str) -> BenchSettingsError:
    return BenchSettingsError(f"bench.{key}={value!r} is not allowed; allowed values: {allowed}")


def _check_values(b: dict[str, Any]) -> None:
    """The ``bench`` group's own values (the grid's axes are checked by ``grid.layouts``)."""
    from megatron_iso.bench.grid import LAUNCHERS

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for key in ("profiles", "tp", "ep", "sp", "cp", "batch", "prompt_len"):
        if not isinstance(b.get(key), list):
            raise _refuse(key, b.get(key), "a list, e.g. [1, 2]")
    if not b["batch"] or not all(is_int(v) and v >= 1 for v in b["batch"]):
        raise _refuse("batch", b["batch"], "a non-empty list of integers >= 1")
    lo_hi = b["prompt_len"]
    if len(lo_hi) != 2 or not all(is_int(v) for v in lo_hi) or not 1 <= lo_hi[0] <= lo_hi[1]:
        raise _refuse("prompt_len", lo_hi, "[min, max], integers with 1 <= min <= max")
    for key in ("new_tokens", "kv_cache_mb"):
        if not is_int(b.get(key)) or b[key] < 1:
            raise _refuse(key, b.get(key), "integers >= 1")
    for key in ("prompt_seed", "sample_seed", "weights_seed"):
        if not is_int(b.get(key)):
            raise _refuse(key, b.get(key), "integers")
    check_temperature(b.get("temperature"), "bench.temperature")
    if not isinstance(b.get("full_vocab"), bool):
        raise _refuse("full_vocab", b.get("full_vocab"), "true or false")
    if b.get("launcher") not in LAUNCHERS:
        raise _refuse("launcher", b.get("launcher"), str(sorted(LAUNCHERS)))
    for key in ("out", "plot"):
        if b.get(key) is not None:
            _check_report_path(key, b[key])


def _check_report_path(key: str, value: Any) -> None:
    """``bench.out`` / ``bench.plot``: a file path to write. Missing directories are made only under the working
    directory (``runs/sweep.json``); elsewhere the directory must exist (a typo in an absolute path would
    otherwise make directories from the file system's root). Its nearest existing directory must be writable."""
    if not isinstance(value, str) or not value.strip():
        raise _refuse(key, value, "null or a file path")
    path = Path(value).expanduser()
    if path.is_dir():
        raise _refuse(key, value, "null or a file path (this names a directory; add a file name, e.g. bench.json)")
    parent = path.absolute().parent
    if not parent.is_dir() and not parent.is_relative_to(Path.cwd()):
        raise _refuse(
            key, value, f"null or a file in an existing directory ({parent} does not exist; missing directories are "
            "made only under the working directory)"
        )  # fmt: skip
    check_writable_dir(parent, shown=f"bench.{key}={value!r}")


def check_bench(cfg: DictConfig) -> None:
    """Every ``bench.*`` setting, and every layout of the grid against the model and the device, checked before
    any rank starts: a :class:`BenchSettingsError` (or the settings' own UserError) names what to change."""
    from megatron_iso.bench.bisect import check_config_runs
    from megatron_iso.bench.grid import layout_config, layouts

    b = OmegaConf.to_container(cfg.bench, resolve=True)
    _check_values(b)
    longest, limit = b["prompt_len"][1] + b["new_tokens"], cfg.model.max_position_embeddings
    if isinstance(limit, int) and longest > limit:
        raise BenchSettingsError(
            f"bench.prompt_len={b['prompt_len']} with bench.new_tokens={b['new_tokens']} makes sequences of up to "
            f"{longest} tokens: the model runs at most model.max_position_embeddings={limit}; allowed values: "
            f"prompt_len[1] + new_tokens <= {limit}"
        )
    try:
        lays, _ = layouts(b["profiles"], b["tp"], b["ep"], b["sp"], b["cp"])
    except ValueError as exc:
        raise BenchSettingsError(str(exc)) from None
    base = OmegaConf.to_container(cfg, resolve=True)
    # What no layout changes (device, model, profile, pipeline) first, told plainly; then each layout's sizes.
    check_config_runs({**base, "parallel": {**base["parallel"], "tp": 1, "ep": 1, "sp": False, "cp": 1}})
    for lay in lays:
        try:
            check_config_runs(layout_config(base, lay))
        except UserError as exc:
            axes = f"bench.tp={b['tp']}, bench.ep={b['ep']}, bench.sp={b['sp']}, bench.cp={b['cp']}"
            raise BenchSettingsError(f"layout {lay.name} of the grid ({axes}): {exc}") from exc


def _prepare(argv: list[str], out: list[str]) -> int:
    """``argv`` with the flags turned into overrides (into ``out``); plain overrides composed and checked, so that
    a bad one is a one-line usage error and not Hydra's report or a rank's traceback."""
    out[:] = launcher_flag(argv)
    if not any(a.startswith("-") for a in out):
        check_overrides(out)
        check_bench(load_config(out, config_name=CONFIG_NAME))
    return EXIT_OK


STUDY_USAGE = """usage: iso-bench study [OVERRIDE ...] [--debug]

Train both profiles (correctness, performance) from the same config, weights, data and seeds for
bench.study.steps RL steps each (iso-train, one run after the other, in <out_dir>/<profile>), then write
study.md (the table: |dlogp| mean / P50 / P95 / P99 / max, reward, KL, clip ratio, loss, gen / train / step
seconds and the overhead of correctness in percent, peak memory, GPU utilisation), study.json and study.png
to out_dir (null: runs/study-<UTC time>-<id>). logger=wandb also logs the study to W&B (offline by default).

  bench.study.steps=N          RL steps per profile (default 5)
  bench.study.warmup_steps=K   first steps left out of the timing means (default 1)
  any other override           both runs' (model=, task.*, rl.*, device=, logger=...); profile=, rl.steps=
                               and resume= are the study's own
"""


def _study(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(STUDY_USAGE, end="")
        return EXIT_OK
    from megatron_iso.bench.study import run_study

    run_study(argv)
    return EXIT_OK


def main() -> None:
    argv = sys.argv[1:]
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ["HYDRA_FULL_ERROR"] = "1"  # run_cli and Hydra both re-raise with the traceback
    if argv[:1] == ["study"]:
        sys.exit(run_cli(f"{PROG} study", lambda: _study(argv[1:])))
    overrides: list[str] = []
    code = run_cli(PROG, lambda: _prepare(argv, overrides))
    if code != EXIT_OK:
        sys.exit(code)
    sys.argv[:] = [PROG, *overrides]  # Hydra's own usage errors then read "iso-bench: error: ..." as well
    hydra.main(config_path=str(conf_dir()), config_name=CONFIG_NAME, version_base=None)(_run)()


if __name__ == "__main__":
    sys.exit(main())
