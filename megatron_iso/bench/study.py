"""``iso-bench study``: what exactness costs and what it changes, from one command.

Both profiles train as ``iso-train`` (:func:`megatron_iso.rl.run.train`) from the same config: the same model and
weights seed, the same data and sampling seeds, ``bench.study.steps`` RL steps each, into ``<study>/correctness``
and ``<study>/performance``. Each run is a process of its own, started one after the other: its timings, peak
memory and device state are its own (two runs in one process would share the peak-RSS counter, allocator and
compile caches; two at once would share the device). Then both runs' ``metrics.jsonl`` are read into one table
(:mod:`megatron_iso.bench.study_report`): ``study.md``, ``study.json`` and ``study.png`` in the study directory,
and a W&B run of the study when ``logger=wandb``.

Every setting is checked for both profiles before the first run starts: a bad one is a one-line usage error and
nothing is written.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_iso.errors import NonFiniteError, UserError
from megatron_iso.rl.run_dir import METRICS_FILE, RUNS_ROOT, new_run_name

PROFILES = ("correctness", "performance")  # the second is the baseline the overhead is measured against
STUDY_FILES = ("study.md", "study.json", "study.png")
# Overrides the study sets itself, each with what to use instead.
RESERVED = {
    "profile": "the study runs both profiles",
    "rl.steps": "set bench.study.steps instead",
    "resume": "a study starts both runs anew",
}
# Per-step metrics study.json keeps of each run (the plots' and the table's inputs).
STEP_KEYS = (
    "reward/mean",
    "mismatch/abs_diff_mean",
    "mismatch/abs_diff_p50",
    "mismatch/abs_diff_p95",
    "mismatch/abs_diff_p99",
    "mismatch/abs_diff_max",
    "mismatch/bitwise_equal_frac",
    "mismatch/k3_kl",
    "policy/clip_frac",
    "loss",
    "timing/gen_s",
    "timing/train_s",
    "timing/step_s",
    "memory/peak_bytes",
)
TIMES = ("gen_s", "train_s", "step_s")


class StudySettingsError(UserError, ValueError):
    """An argument or ``bench.study`` setting the study cannot run; the message names it and what it takes."""


class StudyRunError(UserError, RuntimeError):
    """A profile's run refused its settings (iso-train's usage error); its own line is in the message."""


class StudyRunFailed(RuntimeError):
    """A profile's run failed unexpectedly; its traceback is in its output, streamed above."""


@dataclass(frozen=True)
class StudyPlan:
    out: Path  # the study directory: one run directory per profile, and the study's files
    steps: int
    warmup_steps: int
    run_overrides: tuple[str, ...]  # the user's overrides every run gets (bench.* and out_dir taken out)
    cfg: Mapping[str, Any]  # the composed iso-bench config, resolved to plain containers
    device_class: str  # cpu | cuda, as the runs resolve it


def override_key(arg: str) -> str:
    """The config key a Hydra override sets (``+a.b=1`` and ``~a.b`` -> ``a.b``)."""
    return arg.split("=", 1)[0].lstrip("+~")


def run_command(plan: StudyPlan, profile: str) -> list[str]:
    """The ``iso-train`` command line of ``profile``'s run (the venv's interpreter, the package's module)."""
    return [
        sys.executable,
        "-m",
        "megatron_iso.cli.train",
        *plan.run_overrides,
        f"profile={profile}",
        f"rl.steps={plan.steps}",
        f"out_dir={plan.out / profile}",
    ]


def _int_setting(cfg: Mapping[str, Any], key: str, minimum: int) -> int:
    value = (cfg["bench"].get("study") or {}).get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise StudySettingsError(f"bench.study.{key}={value!r} is not allowed; allowed values: integers >= {minimum}")
    return value


def plan_study(argv: list[str], root: Path = RUNS_ROOT) -> StudyPlan:
    """The study ``argv`` (Hydra overrides of ``iso_bench``) asks for, every setting checked for both profiles
    (:func:`megatron_iso.settings.check_trainable`, what ``iso-train`` checks at start) before anything runs."""
    from megatron_iso.checkpoint.init_from import apply_init_from
    from megatron_iso.settings import check_trainable, resolve
    from megatron_iso.settings.compose import load_config, plain_config

    for arg in argv:
        if arg.startswith("-"):
            raise StudySettingsError(
                f"unknown flag {arg!r}; iso-bench study takes overrides only (e.g. bench.study.steps=3 "
                "model=tiny_moe out_dir=runs/study), and --help"
            )
        key = override_key(arg)
        if key in RESERVED:
            raise StudySettingsError(f"{arg!r} is not allowed: {RESERVED[key]}")
    cfg = plain_config(load_config(argv, config_name="iso_bench"))
    steps = _int_setting(cfg, "steps", 1)
    warmup = _int_setting(cfg, "warmup_steps", 0)
    run_overrides = tuple(a for a in argv if not override_key(a).startswith("bench") and override_key(a) != "out_dir")
    device_class = ""
    for profile in PROFILES:
        overrides = [*run_overrides, f"profile={profile}", f"rl.steps={steps}"]
        try:
            settings = resolve(apply_init_from(load_config(overrides), overrides))
            check_trainable(settings)
        except UserError as exc:
            raise StudySettingsError(f"the {profile} run: {' '.join(str(exc).split())}") from exc
        device_class = settings.device_class
    if cfg.get("out_dir") is not None:
        out = Path(str(cfg["out_dir"]))
        taken = [name for name in (*STUDY_FILES, *PROFILES) if (out / name).exists()]
        if taken:
            raise StudySettingsError(
                f"out_dir={out} already holds {', '.join(taken)}: a study never overwrites another; choose a new out_dir"
            )
    else:
        out = root / f"study-{new_run_name()}"
        while out.exists():  # another study started in the same second and drew the same id
            out = root / f"study-{new_run_name()}"
    return StudyPlan(out, steps, warmup, run_overrides, cfg, device_class)


def _nvml_utilization() -> Any:
    """A function returning the current GPU utilisation in percent (NVML's, as nvidia-smi shows it) of the device the
    runs use, the first visible one; None without NVML. Read through ``pynvml`` itself, not ``torch.cuda``, whose
    device lookup would create a CUDA context (and take GPU memory) in the study's own process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        handle = (
            pynvml.nvmlDeviceGetHandleByUUID(first)
            if first.startswith(("GPU-", "MIG-"))
            else pynvml.nvmlDeviceGetHandleByIndex(int(first or 0))
        )
    except Exception:  # no pynvml, no driver, an odd CUDA_VISIBLE_DEVICES: the table says n/a
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


class GpuSampler:
    """Mean GPU utilisation sampled every ``period_s`` while a run's process lives (:func:`_nvml_utilization`); None
    on the CPU or where NVML cannot be read."""

    def __init__(self, device_class: str, period_s: float = 0.5) -> None:
        self.read = _nvml_utilization() if device_class == "cuda" else None
        self.period_s = period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception:  # NVML stopped answering: no figure rather than a partial one
                self.samples.clear()
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> GpuSampler:
        if self.read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.read is not None:
            self._thread.join()

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_profile(plan: StudyPlan, profile: str, *, echo: bool = True) -> dict[str, Any]:
    """Run ``profile``'s ``iso-train`` to the end, its output streamed to stderr (when ``echo``); returns its run
    directory, wall seconds and mean GPU utilisation. A run that fails raises with its last output line."""
    cmd = run_command(plan, profile)
    tail = ""
    t0 = time.perf_counter()
    with GpuSampler(plan.device_class) as gpu:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(4096):
            text = chunk.decode(errors="replace")
            tail = (tail + text)[-4000:]
            if echo:
                sys.stderr.write(text)
                sys.stderr.flush()
        code = proc.wait()
    wall_s = time.perf_counter() - t0
    if code != 0:
        line = _last_line(tail)
        if code == 2:
            raise StudyRunError(f"the {profile} run refused its settings: {line}")
        if code == 3:
            raise NonFiniteError(f"the {profile} run: {line}")
        raise StudyRunFailed(f"the {profile} run failed (iso-train exit {code}): {line}; its output is above")
    return {"run_dir": str(plan.out / profile), "wall_s": wall_s, "gpu_util_pct": gpu.mean()}


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The training steps' rows of a run's ``metrics.jsonl`` (validation-only rows left out)."""
    import json

    rows = []
    for line in (run_dir / METRICS_FILE).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(row, dict) and "timing/step_s" in row:
            rows.append(row)
    return rows


def _numbers(rows: list[dict[str, Any]], key: str) -> list[float]:
    # A value logged as a string ("nan", "inf": metrics.jsonl's non-finite form) or missing (a step that trained
    # nothing has no mismatch) is left out.
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and not isinstance(r[key], bool)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """One run's row of the study table from its steps: |dlogp| statistics over every step (each step's mean and
    quantiles over its tokens, averaged over the steps; the max over all), the training metrics' means, and the
    timings' means over the steps after ``warmup_steps`` (all steps when none is left)."""
    timed = rows[warmup_steps:] or rows
    step_max = _numbers(rows, "mismatch/abs_diff_max")
    rewards = _numbers(rows, "reward/mean")
    peak = _numbers(rows, "memory/peak_bytes")
    return {
        "steps": len(rows),
        "timed_steps": len(timed),
        "dlogp_mean": _mean(_numbers(rows, "mismatch/abs_diff_mean")),
        **{f"dlogp_p{q}": _mean(_numbers(rows, f"mismatch/abs_diff_p{q}")) for q in (50, 95, 99)},
        "dlogp_max": max(step_max) if step_max else None,
        "dlogp_step_max_mean": _mean(step_max),
        "bitwise_equal_frac": _mean(_numbers(rows, "mismatch/bitwise_equal_frac")),
        "reward_mean": _mean(rewards),
        "reward_last": rewards[-1] if rewards else None,
        "kl_k3": _mean(_numbers(rows, "mismatch/k3_kl")),
        "clip_frac": _mean(_numbers(rows, "policy/clip_frac")),
        "loss": _mean(_numbers(rows, "loss")),
        **{t: _mean(_numbers(timed, f"timing/{t}")) for t in TIMES},
        "peak_mem_bytes": max(peak) if peak else None,
    }


def overhead_pct(study: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """Percent more time ``study`` takes than ``base`` per phase (negative: faster), as IsoExec reports it."""
    out: dict[str, float | None] = {}
    for t in TIMES:
        a, b = study.get(t), base.get(t)
        out[t] = 100.0 * (a - b) / b if a is not None and b else None
    return out


def _device_name(device_class: str) -> str:
    """What ran the study, for its title: the GPU's name, or the CPU cores the runs could use."""
    if device_class == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def study_document(plan: StudyPlan, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``study.json``: the plan, both runs (directory, summary, steps) and the overhead."""
    from megatron_iso.bench.provenance import code_identity

    summaries = {p: runs[p]["summary"] for p in PROFILES}
    return {
        "model": str(plan.cfg["model"]["name"]),
        "device": plan.device_class,
        "study": {
            "steps": plan.steps,
            "warmup_steps": plan.warmup_steps,
            "out": str(plan.out),
            "overrides": list(plan.run_overrides),
            "profiles": list(PROFILES),
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.node(),
            "device_name": _device_name(plan.device_class),
            **code_identity(),
        },
        "runs": runs,
        "overhead_pct": overhead_pct(summaries["correctness"], summaries["performance"]),
    }


def run_study(argv: list[str], *, console: bool = True, root: Path = RUNS_ROOT) -> dict[str, Any]:
    """The whole study (module doc); returns ``study.json``'s document with the table's text under ``table``."""
    from megatron_iso.bench.report import write_json
    from megatron_iso.bench.study_report import log_study_wandb, markdown, write_study_plot

    plan = plan_study(argv, root)
    if console:
        print(f"out_dir={plan.out} (the study's directory: a run directory per profile, study.md/json/png)",
              file=sys.stderr)  # fmt: skip
    plan.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    for i, profile in enumerate(PROFILES):
        if console:
            print(f"iso-bench study: run {i + 1}/2, {' '.join(run_command(plan, profile)[1:])}", file=sys.stderr)
        run = run_profile(plan, profile, echo=console)
        rows = read_steps(Path(run["run_dir"]))
        run["summary"] = {**summarize(rows, plan.warmup_steps), "gpu_util_pct": run["gpu_util_pct"]}
        run["steps"] = [{"step": r["step"], **{k: r[k] for k in STEP_KEYS if k in r}} for r in rows]
        runs[profile] = run
    doc = study_document(plan, runs)
    doc["files"] = {name.split(".")[1]: str(plan.out / name) for name in STUDY_FILES}
    table = markdown(doc)
    (plan.out / "study.md").write_text(table)
    write_study_plot(plan.out / "study.png", doc)
    write_json(plan.out / "study.json", doc)
    log_study_wandb(plan, doc)
    if console:
        print(table)
        print(f"wrote {', '.join(doc['files'].values())}", file=sys.stderr)
    return {**doc, "table": table}
