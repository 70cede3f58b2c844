"""``iso-bench`` as a package function: config -> grid -> JSON, markdown table, PNG plot."""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from megatron_iso.bench.grid import BenchSettings, layouts, run_grid
from megatron_iso.bench.report import print_table, write_json, write_plot


def settings_from_config(cfg: DictConfig) -> BenchSettings:
    b = cfg.bench
    prompt_len = list(b.prompt_len)
    if len(prompt_len) != 2:
        raise ValueError(f"bench.prompt_len={prompt_len!r} is invalid; allowed: [min, max]")
    batches = [int(x) for x in b.batch]
    if not batches or any(x < 1 for x in batches):
        raise ValueError(f"bench.batch={batches!r} is invalid; allowed: a non-empty list of ints >= 1")
    return BenchSettings(
        config=OmegaConf.to_container(cfg, resolve=True),
        batches=tuple(batches),
        prompt_len=(int(prompt_len[0]), int(prompt_len[1])),
        new_tokens=int(b.new_tokens),
        temperature=float(b.temperature),
        prompt_seed=int(b.prompt_seed),
        sample_seed=int(b.sample_seed),
        weights_seed=int(b.weights_seed),
        full_vocab=bool(b.full_vocab),
        kv_cache_mb=int(b.kv_cache_mb),
    )


def run_bench(cfg: DictConfig, *, console: bool = True) -> dict[str, Any]:
    """Run the grid of ``cfg.bench``; write ``bench.out`` (JSON) and the plot; return the document."""
    b = cfg.bench
    lays, notes = layouts(list(b.profiles), [int(x) for x in b.tp], [int(x) for x in b.ep], [bool(x) for x in b.sp])
    settings = settings_from_config(cfg)
    t0 = time.perf_counter()
    rows = run_grid(lays, settings, launcher=str(b.launcher))
    out = Path(str(b.out))
    plot = Path(str(b.plot)) if b.plot else out.with_suffix(".png")
    doc = {
        "model": str(cfg.model.name),
        "params_dtype": str(cfg.model.get("params_dtype", "fp32")),
        "bench": OmegaConf.to_container(b, resolve=True),
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
