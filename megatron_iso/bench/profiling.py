"""torch.profiler helpers shared by the benchmark scripts: where the time of a decode step or an RL
step goes, per model part and per op.

- :func:`module_ranges`: a profiler range around every computing module, named by its path with
  layer indices as ``*`` (``module: decoder.layers.*.mlp``), so one row totals a part over all layers.
- :func:`ranged`: wrap a callable in a named range (``engine: sample``, ``rl: train``).
- :func:`summarize`: a profiler's top ops by self device and self CPU time, the ranges as parts,
  and the device-busy time (sum of self device time: far below wall time means host bound).
- :func:`print_summary`: the same as markdown tables.
"""

from __future__ import annotations

import contextlib
import re
import sys
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
