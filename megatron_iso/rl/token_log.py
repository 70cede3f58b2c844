"""Each step's per-token mismatch detail: the tokens with the largest |dlogp| and a histogram of |dlogp|.

The trainer step gathers the trainer and rollout logprob of every trained token (``Trainer.step``'s parts, one per
data-parallel rank); :func:`token_detail` turns them into

- the worst tokens: the ``WORST_TOKENS`` largest ``|logp_trainer - logp_rollout|`` of the step (ties: the earlier
  token), each with its sequence (the trained sample's index in the step, data-parallel ranks in rank order),
  position in the response, token id and both logprobs. The correctness profile's rows are all exactly 0;
- a histogram of ``log10 |dlogp|`` in half-decade bins from 1e-13 to 10 (values below 1e-13, exact zeros
  included, count in the first bin and also, alone, as ``zero``; values above 10 in the last).

:class:`TokenLog` appends them to the run directory (``worst_tokens.jsonl``: one line per token; ``dlogp_hist.jsonl``:
one line per step) and hands them to W&B as a ``wandb.Table`` and a ``wandb.Histogram`` (``rl.metrics.MetricsLog``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_iso.rl.run_dir import rewind_metrics

WORST_TOKENS_FILE = "worst_tokens.jsonl"
DLOGP_HIST_FILE = "dlogp_hist.jsonl"
WORST_TOKENS = 20
WORST_COLUMNS = ("step", "sequence", "position", "token_id", "rollout_logp", "trainer_logp", "abs_dlogp")
# Histogram bins of log10 |dlogp|: fp32 logprobs of order 1 differ by 6e-8 at the least (one ulp), so 1e-13
# is below any non-zero gap and 10 above any gap of a sane run.
HIST_LOG10_LOW, HIST_LOG10_HIGH, HIST_BINS_PER_DECADE = -13, 1, 2
HIST_EDGES = [HIST_LOG10_LOW + i / HIST_BINS_PER_DECADE for i in range(
    (HIST_LOG10_HIGH - HIST_LOG10_LOW) * HIST_BINS_PER_DECADE + 1)]  # fmt: skip


def trained_token_ids(samples: Sequence[Any], trained_lengths: torch.Tensor) -> torch.Tensor:
    """The token ids behind a step's mismatch tensors: those of its first ``len(trained_lengths)`` kept samples
    (``rl.ppo.run_updates``: the tokens scored at the rollout's weights are always a prefix of the kept samples,
    the first mini-batch or all of them), in order."""
    scored = samples[: len(trained_lengths)]
    if [len(s.tokens) for s in scored] != trained_lengths.tolist():
        raise ValueError("trained_token_ids: trained_lengths are not the first kept samples' lengths")
    return torch.tensor([t for s in scored for t in s.tokens], dtype=torch.long)


def _joined(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One step's tokens over every rank: logprobs, token ids, and each token's sequence and position."""
    lengths = torch.cat([p["trained_lengths"].long() for p in parts])
    starts = torch.cumsum(lengths, 0) - lengths
    return {
        "rollout": torch.cat([p["rollout_logp"] for p in parts]).float(),
        "trainer": torch.cat([p["trainer_logp"] for p in parts]).float(),
        "token_id": torch.cat([p["token_ids"] for p in parts]).long(),
        "sequence": torch.repeat_interleave(torch.arange(lengths.numel()), lengths),
        "position": torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths),
    }


def worst_tokens(step: int, tokens: dict[str, torch.Tensor], k: int = WORST_TOKENS) -> list[dict[str, Any]]:
    """The ``k`` tokens of largest |dlogp| (stable: among equal gaps the earlier token), as rows of WORST_COLUMNS."""
    gap = (tokens["trainer"].double() - tokens["rollout"].double()).abs()
    order = torch.sort(gap, descending=True, stable=True).indices[:k].tolist()
    return [
        {
            "step": step,
            "sequence": int(tokens["sequence"][i]),
            "position": int(tokens["position"][i]),
            "token_id": int(tokens["token_id"][i]),
            "rollout_logp": float(tokens["rollout"][i]),
            "trainer_logp": float(tokens["trainer"][i]),
            "abs_dlogp": float(gap[i]),
        }
        for i in order
    ]


def dlogp_histogram(step: int, tokens: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Counts of log10 |dlogp| over ``HIST_EDGES`` (module doc), the exact zeros and the token count."""
    gap = (tokens["trainer"].double() - tokens["rollout"].double()).abs()
    log10 = torch.log10(gap.clamp(min=10.0**HIST_LOG10_LOW)).clamp(max=HIST_LOG10_HIGH)
    bins = len(HIST_EDGES) - 1
    index = ((log10 - HIST_LOG10_LOW) * HIST_BINS_PER_DECADE).floor().long().clamp(0, bins - 1)
    counts = torch.bincount(index, minlength=bins)
    return {"step": step, "tokens": int(gap.numel()), "zero": int((gap == 0).sum()), "log10_edges": HIST_EDGES,
            "counts": counts.tolist()}  # fmt: skip


def token_detail(step: int, parts: Sequence[dict[str, torch.Tensor]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A step's worst tokens and |dlogp| histogram from its gathered ``parts`` (module doc)."""
    tokens = _joined(parts)
    return worst_tokens(step, tokens), dlogp_histogram(step, tokens)


class TokenLog:
    """``worst_tokens.jsonl`` and ``dlogp_hist.jsonl`` of a run; rewound with ``metrics.jsonl`` on resume."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.worst_path, self.hist_path = run_dir / WORST_TOKENS_FILE, run_dir / DLOGP_HIST_FILE
        if resume_step is not None:
            for path in (self.worst_path, self.hist_path):
                rewind_metrics(run_dir, resume_step, path.name)

    def write(self, step: int, parts: Sequence[dict[str, torch.Tensor]]) -> tuple[list[dict[str, Any]], dict]:
        """Append ``step``'s detail (none for a step that trained no token) and return it."""
        worst, hist = token_detail(step, parts)
        if hist["tokens"]:
            clean = [{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in r.items()}
                     for r in worst]  # fmt: skip
            with self.worst_path.open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in clean))
            with self.hist_path.open("a") as f:
                f.write(json.dumps(hist) + "\n")
        return worst, hist


def wandb_objects(worst: list[dict[str, Any]], hist: dict[str, Any]) -> dict[str, Any]:
    """The step's W&B media: ``mismatch/worst_tokens`` (a ``wandb.Table``) and ``mismatch/abs_diff_log10_hist``
    (a ``wandb.Histogram`` of log10 |dlogp| over the same bins as ``dlogp_hist.jsonl``); {} for no tokens."""
    if not hist["tokens"]:
        return {}
    import wandb

    rows = [[r[c] for c in WORST_COLUMNS] for r in worst]
    return {
        "mismatch/worst_tokens": wandb.Table(columns=list(WORST_COLUMNS), data=rows),
        "mismatch/abs_diff_log10_hist": wandb.Histogram(np_histogram=(hist["counts"], hist["log10_edges"])),
    }
