"""The study's outputs (:mod:`megatron_iso.bench.study`): the markdown table, the PNG plot and the W&B run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_iso.bench.report import format_cell

# (summary key, column header, format of report.format_cell); "overhead" and "gpu_util" are formatted here.
STUDY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("profile", "profile", "s"),
    ("dlogp_mean", "mean |dlogp|", "e"),
    ("dlogp_p50", "P50", "e"),
    ("dlogp_p95", "P95", "e"),
    ("dlogp_p99", "P99", "e"),
    ("dlogp_max", "max |dlogp|", "e"),
    ("dlogp_step_max_mean", "mean step max", "e"),
    ("bitwise_equal_frac", "bitwise equal", "f"),
    ("reward_mean", "reward", "f"),
    ("kl_k3", "KL (k3)", "e"),
    ("clip_frac", "clip ratio", "f"),
    ("loss", "loss", "e"),
    ("gen_s", "gen s", "f"),
    ("train_s", "train s", "f"),
    ("step_s", "step s", "f"),
    ("overhead", "overhead", "s"),
    ("peak_mib", "peak MiB", "f0"),
    ("gpu_util", "GPU util", "s"),
)
COLORS = {"correctness": "tab:green", "performance": "tab:red"}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def table_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The study table's headers and one row of cells per profile (the performance row is the baseline)."""
    headers = [h for _, h, _ in STUDY_COLUMNS]
    rows = []
    for profile, run in doc["runs"].items():
        s = run["summary"]
        peak = s.get("peak_mem_bytes")
        values = {
            **s,
            "profile": profile,
            "overhead": "baseline" if profile == "performance" else _pct(doc["overhead_pct"]["step_s"]),
            "peak_mib": None if peak is None else peak / 2**20,
            "gpu_util": "n/a" if s.get("gpu_util_pct") is None else f"{s['gpu_util_pct']:.0f}%",
        }
        rows.append([format_cell(values.get(k), f) for k, _, f in STUDY_COLUMNS])
    return headers, rows


def _no_gap_note(doc: dict[str, Any]) -> list[str]:
    """A line when the performance run matched bit for bit too: the table then shows the cost, not the gap."""
    perf = doc["runs"].get("performance", {}).get("summary", {})
    if perf.get("dlogp_max") != 0 or perf.get("bitwise_equal_frac") != 1:
        return []
    return [
        "",
        "The performance profile matched bit for bit as well in this run: this model, device and batch do not expose "
        "the rollout-vs-trainer gap, so the table shows what exactness costs, not what it changes (on the CPU, "
        "model=tiny_moe exposes it).",
    ]


def _provenance(doc: dict[str, Any]) -> str:
    """Where the numbers come from: the device, the code (commit and source digest) and the runs' overrides."""
    env = doc.get("environment", {})
    overrides = " ".join(doc["study"].get("overrides", [])) or "none"
    return (
        f"Device: {env.get('device_name', doc['device'])}; commit `{env.get('commit', 'unknown')}` (source sha256 "
        f"`{str(env.get('source_sha256', 'unknown'))[:12]}`), torch {env.get('torch', '?')}; overrides: `{overrides}`."
    )


def markdown(doc: dict[str, Any]) -> str:
    """``study.md``: a title line, the table (pipes in headers escaped, GFM) and what its columns are."""
    headers, rows = table_rows(doc)
    study, over = doc["study"], doc["overhead_pct"]
    timed = next(iter(doc["runs"].values()))["summary"]["timed_steps"]
    lines = [
        f"### iso-bench study: {doc['model']} on {doc['device']}, {study['steps']} RL steps per profile",
        "",
        _provenance(doc),
        "",
        "| " + " | ".join(h.replace("|", "\\|") for h in headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows),
        "",
        f"Overhead of correctness over performance (mean seconds of the last {timed} steps; the first "
        f"{study['steps'] - timed} left out as warm-up): generation {_pct(over['gen_s'])}, training "
        f"{_pct(over['train_s'])}, whole step {_pct(over['step_s'])} (the overhead column).",
        *_no_gap_note(doc),
        "",
        "|dlogp| = |trainer logprob - rollout logprob| of every sampled token: mean and P50 / P95 / P99 are each "
        "step's over its tokens, averaged over the steps; max is the largest of any step, mean step max the mean "
        "of each step's largest. Bitwise equal: the fraction of tokens whose two logprobs have the same bits. "
        "Reward, KL (k3 estimate of KL(rollout || trainer)), clip ratio (tokens outside the PPO clip band) and loss: "
        "means over the steps. Peak MiB: GPU peak allocation on CUDA, the run process's peak RSS on the CPU "
        "(interpreter and imports included). GPU util: NVML's mean over the run's process lifetime (n/a on the "
        "CPU or without pynvml).",
        "",
        "Runs: " + ", ".join(f"{p} `{r['run_dir']}`" for p, r in doc["runs"].items()) + ".",
        "",
    ]
    return "\n".join(lines)


def write_study_plot(path: Path, doc: dict[str, Any]) -> Path:
    """Three panels: each profile's reward per step, side by side on one y scale, and both profiles' max |dlogp|
    per step (symlog: an exact 0 sits on the axis and 1e-7 stays apart from it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = doc["runs"]
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(5 * (len(runs) + 1), 4.5))
    reward_axes, gap_ax = axes[:-1], axes[-1]
    for ax, (profile, run) in zip(reward_axes, runs.items(), strict=True):
        steps = run["steps"]

        def series(key: str, steps: list[dict[str, Any]] = steps) -> tuple[list[int], list[float]]:
            pts = [(s["step"], s[key]) for s in steps if isinstance(s.get(key), int | float)]
            return [p[0] for p in pts], [p[1] for p in pts]

        color = COLORS.get(profile)
        ax.plot(*series("reward/mean"), marker=".", color=color)
        ax.set_title(f"reward per step: {profile}")
        xs, ys = series("mismatch/abs_diff_max")
        zero = bool(ys) and all(v == 0 for v in ys)
        gap_ax.plot(xs, ys, marker=".", color=color, label=profile + (" (exactly 0 at every step)" if zero else ""))
    lows, highs = zip(*(ax.get_ylim() for ax in reward_axes), strict=True)
    for ax in reward_axes:
        ax.set_ylim(min(lows), max(highs))  # one scale: the curves compare by eye
    gap_ax.set_title("max |logp_trainer - logp_rollout| per step")
    gap_ax.set_yscale("symlog", linthresh=1e-9)
    gap_ax.set_ylim(bottom=0)
    gap_ax.legend(loc="best")
    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(f"iso-bench study: {doc['model']} on {doc['device']}, same weights, data and seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def log_study_wandb(plan: Any, doc: dict[str, Any]) -> None:
    """With ``logger=wandb``: a W&B run of the study in its directory (offline unless ``logger.mode=online``): the
    table (``study/table``), the plot (``study/plot``), both profiles' reward and max |dlogp| per step on one
    ``step`` axis (``<profile>/reward``, ``<profile>/dlogp_max``), and the summaries (``<profile>/<key>``,
    ``overhead_pct/<phase>``). Each profile's own run logs to W&B by itself (the same logger settings)."""
    from megatron_iso.rl.metrics import open_wandb_run
    from megatron_iso.settings import check_logger

    name, mode = check_logger(plan.cfg.get("logger"))
    if name != "wandb":
        return
    import wandb

    run = open_wandb_run(plan.out, plan.cfg.get("logger") or {}, {**plan.cfg, "study": doc["study"]}, mode)
    try:
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        by_step: dict[int, dict[str, float]] = {}
        for profile, r in doc["runs"].items():
            for s in r["steps"]:
                row = by_step.setdefault(int(s["step"]), {})
                for key, short in (("reward/mean", "reward"), ("mismatch/abs_diff_max", "dlogp_max")):
                    if isinstance(s.get(key), int | float):
                        row[f"{profile}/{short}"] = float(s[key])
        for step in sorted(by_step):
            run.log({"step": step, **by_step[step]})
        headers, rows = table_rows(doc)
        run.log({"study/table": wandb.Table(columns=headers, data=rows),
                 "study/plot": wandb.Image(str(Path(doc["files"]["png"])))})  # fmt: skip
        summary = {f"{p}/{k}": v for p, r in doc["runs"].items() for k, v in r["summary"].items() if v is not None}
        run.summary.update({**summary, **{f"overhead_pct/{k}": v for k, v in doc["overhead_pct"].items()}})
    finally:
        run.finish()
