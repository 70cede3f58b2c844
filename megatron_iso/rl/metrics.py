"""Step metrics: rollout-vs-trainer mismatch, the metrics.jsonl log, W&B and the PNG dashboard."""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from megatron_iso.rl.run_dir import METRICS_FILE, RunDirError, rewind_metrics
from megatron_iso.rl.token_log import TokenLog, wandb_objects
from megatron_iso.settings import check_logger

# How long an online W&B start may wait for the server before the run falls back to offline.
WANDB_PROBE_S = 5.0


def _wandb_reachable(timeout_s: float = WANDB_PROBE_S) -> bool:
    """Whether the W&B server (``$WANDB_BASE_URL`` or the public one) accepts a TCP connection."""
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "api.wandb.ai", port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def open_wandb_run(run_dir: Path, logger_cfg: Any, config: dict[str, Any], mode: str):
    """A W&B run in ``mode`` (``logger.mode``, checked); an online run whose server cannot be reached falls back
    to offline (the run can be synced later with ``wandb sync``) instead of stalling the first step."""
    import wandb

    if mode == "online" and not _wandb_reachable():
        print(
            f"W&B server unreachable within {WANDB_PROBE_S:.0f} s: logging offline under {run_dir}/wandb "
            "(upload later with `wandb sync`)",
            file=sys.stderr,
        )
        mode = "offline"
    return wandb.init(
        project=str(logger_cfg.get("project", "megatron_iso")),
        entity=logger_cfg.get("entity"),
        mode=mode,
        dir=str(run_dir),
        config=config,
        resume="allow",
        id=run_dir.name + "-" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8],
    )


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
    tokens whose rollout-vs-trainer ratio alone falls outside the clip band; ``mismatch/chi2`` is the
    chi-square divergence ``E[r^2] - 1`` of the token ratio ``r = exp(trainer - rollout)`` (verl's
    ``rollout_corr/chi2_token``); ``mismatch/ppl_ratio`` is the rollout's perplexity over the trainer's,
    ``exp(mean(-rollout)) / exp(mean(-trainer)) = exp(mean(trainer) - mean(rollout))`` over the tokens (one
    ``exp``: no overflow of either perplexity). Both are exactly 0 / 1 when the logprobs agree.
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
        "mismatch/chi2": float((ratio * ratio).mean() - 1.0),
        "mismatch/ppl_ratio": float(torch.exp(trainer_logp.double().mean() - rollout_logp.double().mean())),
    }


# Response-position buckets of position_mismatch: quarters of each response.
POSITION_BUCKETS = 4


def position_mismatch(
    rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, lengths: torch.Tensor
) -> dict[str, float]:
    """Mean ``|trainer - rollout|`` by where a token sits in its response (long responses drift late): token ``p``
    (0-based) of a response of ``L`` tokens falls in quarter ``floor(4 p / L)``, so ``mismatch/abs_diff_mean_q1`` is
    the first 25% of every response and ``..._q4`` the last 25%, whatever the lengths (a response shorter than 4
    tokens leaves some quarters empty; a quarter no token falls in is not logged). Logprobs fp32 ``[N]``, the tokens
    of samples of ``lengths`` tokens, in order."""
    if rollout_logp.numel() == 0:
        return {}
    lengths = lengths.long()
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(rollout_logp.numel()) - torch.repeat_interleave(starts, lengths)
    bucket = POSITION_BUCKETS * position // torch.repeat_interleave(lengths, lengths)
    gap = (trainer_logp.double() - rollout_logp.double()).abs()
    return {
        f"mismatch/abs_diff_mean_q{q + 1}": float(gap[bucket == q].mean())
        for q in range(POSITION_BUCKETS)
        if bool((bucket == q).any())
    }


def alias_metrics(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """The rollout-vs-trainer gap under the names other frameworks log it (both logprobs fp32 ``[N]``, the tokens
    of samples of ``lengths`` tokens, in order):

    - ``training/rollout_probs_diff_max`` / ``_mean`` (verl): max / mean over tokens of ``|p_trainer - p_rollout|``,
      probabilities, not logprobs;
    - ``train/token_mult_prob_error`` (NeMo-RL): the token mean of ``exp(|logp_trainer - logp_rollout|)``, 1 when
      they agree;
    - ``train/train_rollout_logprob_abs_diff`` (slime): ``|logp_trainer - logp_rollout|`` averaged over each
      sample's tokens, then over samples.
    """
    if rollout_logp.numel() == 0:
        return {}
    gap = (trainer_logp.double() - rollout_logp.double()).abs()
    probs = (trainer_logp.double().exp() - rollout_logp.double().exp()).abs()
    per_sample = torch.segment_reduce(gap, "mean", lengths=lengths.long()) if lengths.numel() else gap
    return {
        "training/rollout_probs_diff_max": float(probs.max()),
        "training/rollout_probs_diff_mean": float(probs.mean()),
        "train/token_mult_prob_error": float(gap.exp().mean()),
        "train/train_rollout_logprob_abs_diff": float(per_sample.mean()),
    }


def step_metrics(parts: list[dict[str, torch.Tensor]], clip_low: float, clip_high: float) -> dict[str, float]:
    """A step's rollout statistics over every DP rank's ``parts`` (each: ``trainer_logp`` / ``rollout_logp`` of the
    trained tokens, ``trained_lengths`` of their samples, ``entropy`` per trained token, and per sample
    ``rewards``, ``lengths``, ``truncated``):

    mismatch (:func:`mismatch_metrics`, :func:`position_mismatch`) and its aliases (:func:`alias_metrics`); ``reward/mean``, ``reward/std``;
    ``response/length_mean``, ``response/length_max`` (tokens, stop token included), ``response/truncated_frac``
    (samples that ended at the length limit, not at a stop token); ``policy/entropy``: the token mean of the
    sampling distribution's entropy (temperature-scaled full vocab, before top-k / top-p) over the trained
    tokens, from the trainer's forward (``rl.log_entropy``). verl's names for the same: ``response_length/*``,
    ``actor/entropy``.
    """

    def cat(key: str) -> torch.Tensor:
        return torch.cat([p[key] for p in parts])

    trainer_logp, rollout_logp, rewards = cat("trainer_logp"), cat("rollout_logp"), cat("rewards")
    lengths, truncated, entropy = cat("lengths").double(), cat("truncated").double(), cat("entropy")
    out = mismatch_metrics(rollout_logp, trainer_logp, clip_low, clip_high)
    out |= alias_metrics(rollout_logp, trainer_logp, cat("trained_lengths"))
    out |= position_mismatch(rollout_logp, trainer_logp, cat("trained_lengths"))
    out |= {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(truncated.mean()),
    }
    out |= {"response_length/mean": out["response/length_mean"], "response_length/max": out["response/length_max"],
            "response_length/clip_ratio": out["response/truncated_frac"]}  # fmt: skip
    if entropy.numel():
        out["policy/entropy"] = out["actor/entropy"] = float(entropy.double().mean())
    return out


def contract_summary(identities: dict[str, str]) -> dict[str, str]:
    """The contract's three identities (semantic, numerical_policy, deployment) as run-summary keys."""
    return {f"contract/{k}": v for k, v in sorted(identities.items())}


class MetricsLog:
    """``metrics.jsonl`` (one JSON object per step) plus an optional W&B run.

    On resume the log is rewound to the checkpointed step first (``run_dir.rewind_metrics``: the
    recomputed steps' old lines are kept aside), so a resumed run's file equals the uninterrupted
    run's. A new run never overwrites an existing log. The W&B run's config holds ``config`` (the run's, with
    the contract's identities under ``contract``), and its summary the identities as ``contract/<name>`` plus
    ``summary`` (what the run's data reported at start), so runs can be filtered by contract.

    W&B: every metric is plotted against ``step`` (``wandb.define_metric``); a step's per-token detail (``log``'s
    ``tokens``: :mod:`megatron_iso.rl.token_log`) adds the worst-tokens table and the |dlogp| histogram, which are
    also appended to ``worst_tokens.jsonl`` / ``dlogp_hist.jsonl`` with or without W&B; the dashboard PNG
    (:meth:`write_dashboard`) is logged as an image. Panels to pin: docs/DATA.md, "W&B panels".
    """

    def __init__(
        self,
        run_dir: Path,
        logger_cfg: Any,
        config: dict[str, Any],
        *,
        resume_step: int | None,
        enabled: bool,
        summary: dict[str, Any] | None = None,
    ) -> None:
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.wandb = None
        self.last_step: int | None = None
        profile = (config.get("profile") or {}).get("name", "?")
        policy = str((config.get("contract") or {}).get("numerical_policy", "?"))[:12]
        self.title = f"{run_dir.name}: profile {profile}, policy {policy}"  # the dashboard's
        if not enabled:
            return
        if resume_step is not None:
            rewind_metrics(run_dir, resume_step)
        elif self.path.exists():
            raise RunDirError(f"{self.path} exists; a new run never overwrites another run's metrics")
        self.tokens = TokenLog(run_dir, resume_step)
        name, mode = check_logger(logger_cfg)
        if name == "wandb":
            self.wandb = open_wandb_run(run_dir, logger_cfg, config, mode)
            run_summary = getattr(self.wandb, "summary", None)  # absent on a disabled run's stand-in
            if run_summary is not None:
                run_summary.update({**contract_summary(config.get("contract") or {}), **(summary or {})})
            define = getattr(self.wandb, "define_metric", None)  # absent on test stand-ins
            if define is not None:
                define("step")
                define("*", step_metric="step")  # every panel's x axis: the RL step, not W&B's log counter
                define("mismatch/abs_diff_max", step_metric="step", summary="max")

    def log(
        self, step: int, metrics: dict[str, float], tokens: Sequence[dict[str, torch.Tensor]] | None = None
    ) -> None:
        """Append ``step``'s ``metrics``; ``tokens`` (the step's gathered per-token parts, ``Trainer.step_tokens``)
        also writes its worst tokens and |dlogp| histogram (:mod:`megatron_iso.rl.token_log`)."""
        if not self.enabled:
            return
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        media = {}
        if tokens is not None:
            worst, hist = self.tokens.write(step, tokens)
            media = wandb_objects(worst, hist) if self.wandb is not None else {}
        if self.wandb is not None:
            self.wandb.log({**metrics, **media, "step": step}, step=step)
        self.last_step = step

    def write_dashboard(self) -> Path | None:
        """The PNG dashboard of the log so far (:func:`write_dashboard`, ``dashboard.png`` beside it), also logged to
        W&B as ``dashboard`` (a ``wandb.Image``) at the last logged step; None where nothing was logged."""
        if not self.enabled or not self.path.exists():
            return None
        png = write_dashboard(self.path, self.path.with_name("dashboard.png"), title=self.title)
        if self.wandb is not None and self.last_step is not None:
            import wandb

            self.wandb.log({"dashboard": wandb.Image(str(png)), "step": self.last_step}, step=self.last_step)
        return png

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


DASHBOARD_PANELS = (
    ("reward/mean", "reward"),
    ("mismatch/abs_diff_max", "max |dlogp| rollout vs trainer"),
    ("mismatch/abs_diff_mean", "mean |dlogp|"),
    ("mismatch/bitwise_equal_frac", "tokens bitwise equal (fraction)"),
    ("mismatch/clip_frac", "mismatch clip fraction"),
    ("mismatch/k3_kl", "KL(rollout || trainer), k3"),
    ("grad_norm", "gradient norm"),  # the on-policy surrogate loss itself is ~0 by construction
    ("timing/step_s", "step time (s)"),
)
# Panels whose values span decades down to exactly 0: a symmetric-log axis keeps 1e-7 apart from 0.
SYMLOG_PANELS = {"mismatch/abs_diff_max": 1e-9, "mismatch/abs_diff_mean": 1e-10, "mismatch/k3_kl": 1e-14}


def write_dashboard(metrics_path: Path, out_png: Path, title: str | None = None) -> Path:
    """Plot the run's metrics.jsonl into a PNG grid (one panel per key in DASHBOARD_PANELS); ``title``
    names the run (its profile and contract digest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for line in metrics_path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a crashed run
    fig, axes = plt.subplots(2, 4, figsize=(17, 6.5))
    for ax, (key, panel) in zip(axes.flat, DASHBOARD_PANELS, strict=True):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".")
            if all(v == 0 for _, v in pts):
                ax.text(0.5, 0.5, "exactly 0 at every step", transform=ax.transAxes, ha="center")
        if key in SYMLOG_PANELS:
            ax.set_yscale("symlog", linthresh=SYMLOG_PANELS[key])
            ax.set_ylim(bottom=0)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
