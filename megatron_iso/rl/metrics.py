"""Step metrics: rollout-vs-trainer mismatch, the metrics.jsonl log, W&B and the PNG dashboard."""

from __future__ import annotations

import hashlib
import json
import math
import resource
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated on ``device``, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def mismatch_metrics(
    rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, clip_low: float, clip_high: float
) -> dict[str, float]:
    """Statistics of ``|trainer - rollout|`` over sampled tokens (both fp32 ``[N]``).

    ``mismatch/k3_kl`` estimates KL(rollout || trainer) with k3; ``mismatch/clip_frac`` is the share of
    tokens whose rollout-vs-trainer ratio alone falls outside the clip band.
    """
    if rollout_logp.numel() == 0:
        return {}
    d = (trainer_logp.double() - rollout_logp.double()).abs()
    q = torch.quantile(d, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64))
    log_ratio = trainer_logp.double() - rollout_logp.double()
    ratio = torch.exp(log_ratio)
    k3 = torch.exp(-log_ratio) - 1.0 + log_ratio  # ratio_rollout/trainer form of k3
    return {
        "mismatch/abs_diff_mean": float(d.mean()),
        "mismatch/abs_diff_p50": float(q[0]),
        "mismatch/abs_diff_p95": float(q[1]),
        "mismatch/abs_diff_p99": float(q[2]),
        "mismatch/abs_diff_max": float(d.max()),
        "mismatch/bitwise_equal_frac": float(
            (trainer_logp.view(torch.int32) == rollout_logp.view(torch.int32)).double().mean()
        ),
        "mismatch/k3_kl": float(k3.mean()),
        "mismatch/clip_frac": float(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).double().mean()),
    }


class MetricsLog:
    """``metrics.jsonl`` (one JSON object per step) plus an optional W&B run.

    On resume the log is cut back to the checkpointed step first, so a resumed run's file equals
    the uninterrupted run's.
    """

    def __init__(
        self, run_dir: Path, logger_cfg: Any, config: dict[str, Any], *, resume_step: int | None, enabled: bool
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.wandb = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] < resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif self.path.exists():
            self.path.unlink()
        name = str(logger_cfg.get("name", "none"))
        if name == "wandb":
            import wandb

            mode = str(logger_cfg.get("mode", "offline"))
            if mode not in ("offline", "online", "disabled"):
                raise ValueError(
                    f"logger.mode={mode!r} is not allowed; allowed values: ['offline', 'online', 'disabled']"
                )
            self.wandb = wandb.init(
                project=str(logger_cfg.get("project", "megatron_iso")),
                entity=logger_cfg.get("entity"),
                mode=mode,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=run_dir.name + "-" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8],
            )
        elif name != "none":
            raise ValueError(f"logger.name={name!r} is not allowed; allowed values: ['none', 'wandb']")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


DASHBOARD_PANELS = (
    ("reward/mean", "reward"),
    ("mismatch/abs_diff_max", "max |dlogp| rollout vs trainer"),
    ("mismatch/abs_diff_mean", "mean |dlogp|"),
    ("mismatch/clip_frac", "mismatch clip fraction"),
    ("grad_norm", "gradient norm"),  # the on-policy surrogate loss itself is ~0 by construction
    ("timing/step_s", "step time (s)"),
)


def write_dashboard(metrics_path: Path, out_png: Path) -> Path:
    """Plot the run's metrics.jsonl into a PNG grid (one panel per key in DASHBOARD_PANELS)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, DASHBOARD_PANELS, strict=True):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
