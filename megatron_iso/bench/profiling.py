"""torch.profiler helpers shared by the benchmark scripts: where the time of a decode step or an RL
step goes, per model part and per op.

- :func:`module_ranges`: a profiler range around every computing module, named by its path with
  layer indices as ``*`` (``module: decoder.layers.*.mlp``), so one row totals a part over all layers.
- :func:`ranged`: wrap a callable in a named range (``engine: sample``, ``rl: train``).
- :func:`summarize`: a profiler's top ops by self device and self CPU time, the ranges as parts,
  and the device-busy time (sum of self device time: far below wall time means host bound).
- :func:`print_summary`: the same as markdown tables.
- :func:`kernel_events`: the device kernels of a profile's trace (exported once: torch allows no second export).
- :func:`kernel_launches`: every device kernel of a profile, grouped by name, with its launch shape
  (grid, block, registers per thread, shared memory, estimated occupancy) read from the trace.
- :func:`kernel_span_ms`: the device time its kernels cover, overlaps counted once (the measure of a step
  whose kernels overlap through a programmatic dependent launch).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

RANGE_PREFIXES = ("module: ", "engine: ", "rl: ")  # labels of the ranges these helpers add


def ranged(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` inside a profiler range named ``label``."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module) -> Iterator[None]:
    """A range per computing module of ``model`` while the context is open (forward hooks)."""
    stack: list = []

    def opener(label: str):
        def hook(module, inputs):
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            stack.append(rf)

        return hook

    def close(module, inputs, output):
        stack.pop().__exit__(None, None, None)

    handles = []
    for name, mod in model.named_modules():
        inert = isinstance(mod, torch.nn.ModuleList | torch.nn.Dropout) or type(mod).__name__.startswith("Identity")
        if name and not inert:
            label = "module: " + re.sub(r"\.\d+(?=\.|$)", ".*", name)
            handles += [mod.register_forward_pre_hook(opener(label)), mod.register_forward_hook(close)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def summarize(prof: torch.profiler.profile, rows: int, device: bool) -> dict[str, Any]:
    """Top ``rows`` ops by self device / self CPU time, the labelled ranges, and device-busy seconds."""
    avgs = prof.key_averages()
    ops = [e for e in avgs if not e.key.startswith(RANGE_PREFIXES)]
    parts = sorted(
        (e for e in avgs if e.key.startswith(RANGE_PREFIXES)),
        key=lambda e: e.device_time_total if device else e.cpu_time_total,
        reverse=True,
    )

    def top(attr: str) -> list[dict[str, Any]]:
        ranked = sorted(ops, key=lambda e: getattr(e, attr), reverse=True)[:rows]
        return [
            {"name": e.key, "count": e.count, "self_device_ms": e.self_device_time_total / 1e3,
             "self_cpu_ms": e.self_cpu_time_total / 1e3}
            for e in ranked
        ]  # fmt: skip

    return {
        "device_busy_s": sum(e.self_device_time_total for e in ops) / 1e6 if device else None,
        "top_device_ops": top("self_device_time_total") if device else [],
        "top_cpu_ops": top("self_cpu_time_total"),
        "parts": [
            {"name": e.key, "count": e.count, "device_ms": e.device_time_total / 1e3, "cpu_ms": e.cpu_time_total / 1e3}
            for e in parts[:rows]
        ],
    }


def print_summary(summary: dict[str, Any]) -> None:
    """Markdown tables of :func:`summarize`'s result."""
    for title, ops in (("self CUDA", summary["top_device_ops"]), ("self CPU", summary["top_cpu_ops"])):
        if ops:
            print(f"\nTop ops by {title} time\n\n| op | calls | self CUDA ms | self CPU ms |\n|---|---|---|---|")
            for o in ops:
                print(f"| {o['name'][:90]} | {o['count']} | {o['self_device_ms']:.2f} | {o['self_cpu_ms']:.2f} |")
    print("\n| part (inclusive) | calls | CUDA ms | CPU ms |\n|---|---|---|---|")
    for o in summary["parts"]:
        print(f"| {o['name']} | {o['count']} | {o['device_ms']:.2f} | {o['cpu_ms']:.2f} |")
    sys.stdout.flush()


def kernel_events(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """The device kernel events of ``prof``'s Chrome trace (each with ``ts``, ``dur`` in us and its ``args``), the
    input of :func:`kernel_launches` and :func:`kernel_span_ms`. A profile's trace can be exported once only (torch
    raises "Trace is already saved"), so read it once and pass the list on."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return [ev for ev in events if ev.get("cat") == "kernel"]


def kernel_span_ms(events: list[dict[str, Any]]) -> float:
    """Device time covered by the kernel ``events`` (:func:`kernel_events`): the length of the union of their [start,
    end) intervals, in ms. Kernels that overlap (a programmatic dependent launch starts the next kernel while the last
    one runs) count once, idle gaps not at all; for kernels that run one after another it equals the sum of their
    durations."""
    span, end = 0.0, float("-inf")
    for ev in sorted(events, key=lambda ev: ev["ts"]):
        start, stop = ev["ts"], ev["ts"] + ev.get("dur", 0.0)
        span += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return span / 1e3


def kernel_launches(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernel ``events`` of a profile (:func:`kernel_events`) by name, most device time first: calls, total and
    mean ms, and the launch shapes the trace records (distinct grids; block, registers per thread, static + dynamic
    shared bytes, est. achieved occupancy % of the first launch). The grid is not in ``key_averages()``; the
    exported Chrome trace carries it in each kernel event's ``args``."""
    rows: dict[str, dict[str, Any]] = {}
    for ev in events:
        a = ev.get("args", {})
        r = rows.setdefault(ev["name"], {
            "name": ev["name"], "calls": 0, "device_ms": 0.0, "grids": [], "block": a.get("block"),
            "registers_per_thread": a.get("registers per thread"), "shared_bytes": a.get("shared memory"),
            "est_occupancy_pct": a.get("est. achieved occupancy %"),
        })  # fmt: skip
        r["calls"] += 1
        r["device_ms"] += ev.get("dur", 0.0) / 1e3
        grid = a.get("grid")
        if grid is not None and grid not in r["grids"] and len(r["grids"]) < 4:
            r["grids"].append(grid)
    out = sorted(rows.values(), key=lambda r: r["device_ms"], reverse=True)
    for r in out:
        r["mean_ms"] = r["device_ms"] / r["calls"]
    return out


def print_kernel_launches(kernels: list[dict[str, Any]]) -> None:
    """Markdown table of :func:`kernel_launches`."""
    print(
        "\n| kernel | calls | CUDA ms | mean ms | grid(s) | block | regs | shared B | occ % |\n|---|---|---|---|---|---|---|---|---|"
    )
    for k in kernels:
        grids = " ".join("x".join(str(d) for d in g) for g in k["grids"])
        block = "x".join(str(d) for d in k["block"]) if k["block"] else "-"
        print(
            f"| {k['name'][:60]} | {k['calls']} | {k['device_ms']:.3f} | {k['mean_ms']:.3f} | {grids} | {block} | "
            f"{k['registers_per_thread']} | {k['shared_bytes']} | {k['est_occupancy_pct']} |"
        )
    sys.stdout.flush()
