"""The benchmark's outputs: JSON document, markdown table (printed with rich), PNG plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_iso.registry import Profile

# (row key, column header, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("profile", "profile", "s"),
    ("tp", "TP", "d"),
    ("ep", "EP", "d"),
    ("sp", "SP", "b"),
    ("cp", "CP", "d"),
    ("batch", "batch", "d"),
    ("generated_tokens", "tokens", "d"),
    ("dlogp_mean", "mean |dlogp|", "e"),
    ("dlogp_p50", "P50", "e"),
    ("dlogp_p95", "P95", "e"),
    ("dlogp_p99", "P99", "e"),
    ("dlogp_max", "max |dlogp|", "e"),
    ("full_vocab_dlogp_max", "max |dlogp| full vocab", "e"),
    ("bitwise_equal_frac", "bitwise equal", "f"),
    ("tokens_per_s", "tok/s", "f1"),
    ("peak_mem_mb", "peak MiB", "f0"),
)


def format_cell(value: Any, fmt: str) -> str:
    """A table cell: ``-`` for a missing value, an exact 0 as ``0`` under ``e``; ``fmt`` b | e | f | f<digits> | s."""
    if value is None:
        return "-"
    if fmt == "b":
        return "on" if value else "off"
    if fmt == "e":
        return "0" if value == 0 else f"{value:.3e}"  # an exact zero is the claim: print it as one
    if fmt == "f":
        return f"{value:.3f}"
    if fmt.startswith("f"):
        return f"{value:.{fmt[1:]}f}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    # Pipes inside a cell are escaped (GFM), so "|dlogp|" does not split the column.
    lines = ["| " + " | ".join(h.replace("|", "\\|") for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(format_cell(r.get(k), f) for k, _, f in cols) + " |")
    return "\n".join(lines)


def print_table(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """Print the markdown table verbatim (copy-pasteable into docs) through rich; return its text."""
    from rich.console import Console

    text = (f"### {title}\n\n" if title else "") + markdown_table(rows)
    Console(soft_wrap=True).print(text, markup=False, highlight=False)
    return text


def write_json(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = json.loads(json.dumps(document, default=str), parse_constant=str)
    path.write_text(json.dumps(_finite(clean), indent=1) + "\n")
    return path


def _finite(x: Any) -> Any:
    # JSON has no inf/nan; keep them readable as strings.
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def write_plot(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Two panels per row label (layout, batch): max |dlogp| (sampled and full vocab) and tokens/s.

    The |dlogp| axis is symlog so that an exact 0 (the iso rows) sits visibly on the axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['layout']}\nb{r['batch']}" for r in rows]
    x = list(range(len(rows)))
    colors = ["tab:green" if r["profile"] == Profile.CORRECTNESS else "tab:red" for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(rows)), 8), sharex=True)
    ax1.bar([i - 0.2 for i in x], [r["dlogp_max"] for r in rows], width=0.4, color=colors, label="sampled tokens")
    full = [r.get("full_vocab_dlogp_max") for r in rows]
    if any(v is not None for v in full):
        ax1.bar([i + 0.2 for i in x], [v or 0.0 for v in full], width=0.4, color=colors, alpha=0.45, label="full vocab")
    ax1.set_yscale("symlog", linthresh=1e-9)
    ax1.set_ylabel("max |logp_trainer - logp_rollout|")
    ax1.set_title("rollout vs trainer logprob mismatch (green: correctness, red: performance)")
    ax1.legend(loc="upper left")
    ax2.bar(x, [r["tokens_per_s"] for r in rows], color=colors)
    ax2.set_ylabel("rollout tokens/s")
    ax2.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
