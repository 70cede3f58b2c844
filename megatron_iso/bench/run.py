"""``iso-bench`` as a package function: config -> grid -> JSON, markdown table, PNG plot."""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_iso.bench.grid import BenchSettings, layouts, run_grid
from megatron_iso.bench.report import print_table, write_json, write_plot
from megatron_iso.rl.run_dir import RUNS_ROOT, new_run_name
from megatron_iso.settings.compose import plain_config


def settings_from_config(cfg: Mapping[str, Any]) -> BenchSettings:
    """The grid's settings from the composed ``iso_bench`` config (``bench.*``)."""
    cfg = plain_config(cfg)
    b = cfg["bench"]
    prompt_len = list(b["prompt_len"])
    if len(prompt_len) != 2:
        raise ValueError(f"bench.prompt_len={prompt_len!r} is invalid; allowed: [min, max]")
    batches = [int(x) for x in b["batch"]]
    if not batches or any(x < 1 for x in batches):
        raise ValueError(f"bench.batch={batches!r} is invalid; allowed: a non-empty list of ints >= 1")
    return BenchSettings(
        config=cfg,
        batches=tuple(batches),
        prompt_len=(int(prompt_len[0]), int(prompt_len[1])),
        new_tokens=int(b["new_tokens"]),
        temperature=float(b["temperature"]),
        prompt_seed=int(b["prompt_seed"]),
        sample_seed=int(b["sample_seed"]),
        weights_seed=int(b["weights_seed"]),
        full_vocab=bool(b["full_vocab"]),
        kv_cache_mb=int(b["kv_cache_mb"]),
    )


BENCH_FILE = "bench.json"


def bench_out(cfg: Mapping[str, Any], root: Path = RUNS_ROOT) -> Path:
    """Where the JSON report goes: ``bench.out``; without one (null), ``<out_dir>/bench.json`` when ``out_dir`` is
    set, else ``bench.json`` in a new directory ``root/bench-<UTC start time>-<random id>`` (the naming of
    ``rl.run_dir.new_run_name``: a bare ``iso-bench`` never overwrites an earlier report)."""
    out = cfg["bench"].get("out")
    if out is not None:
        return Path(str(out))
    if cfg.get("out_dir") is not None:
        return Path(str(cfg["out_dir"])) / BENCH_FILE
    name = f"bench-{new_run_name()}"
    while (root / name).exists():  # another bench started in the same second and drew the same id
        name = f"bench-{new_run_name()}"
    return root / name / BENCH_FILE


def run_bench(cfg: Mapping[str, Any], *, console: bool = True) -> dict[str, Any]:
    """Run the grid of ``cfg.bench``; write the JSON report (:func:`bench_out`) and the plot; return the document."""
    cfg = plain_config(cfg)
    b = cfg["bench"]
    lays, notes = layouts(
        list(b["profiles"]),
        [int(x) for x in b["tp"]],
        [int(x) for x in b["ep"]],
        [bool(x) for x in b["sp"]],
        [int(x) for x in b["cp"]],
    )
    settings = settings_from_config(cfg)
    out = bench_out(cfg)
    if console and b.get("out") is None:
        print(f"bench.out={out} (bench.out=PATH chooses the report's file)", file=sys.stderr)
    t0 = time.perf_counter()
    rows = run_grid(lays, settings, launcher=str(b["launcher"]))
    plot = Path(str(b["plot"])) if b.get("plot") else out.with_suffix(".png")
    doc = {
        "model": str(cfg["model"]["name"]),
        "params_dtype": str(cfg["model"].get("params_dtype", "fp32")),
        "bench": {**b, "out": str(out), "plot": str(plot)},
        "notes": notes,
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.node()},
        "wall_seconds": time.perf_counter() - t0,
        "rows": rows,
    }
    write_json(out, doc)
    write_plot(plot, rows)
    doc["table"] = print_table(rows, f"iso-bench: {doc['model']} ({doc['params_dtype']})") if console else None
    if console:
        for n in notes:
            print(n)
        print(f"wrote {out} and {plot}")
    return doc
