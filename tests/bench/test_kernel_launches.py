"""kernel_launches: device kernels of a profiler trace grouped by name, with their launch shapes."""

from __future__ import annotations

import json

import pytest

from megatron_iso.bench.profiling import kernel_launches


class _TraceStub:
    """Stands in for torch.profiler.profile: exports a fixed Chrome trace (CPU has no kernel events)."""

    def __init__(self, events: list[dict]) -> None:
        self.events = events

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events}, f)


def _kernel(name: str, dur_us: float, grid: list[int]) -> dict:
    args = {"grid": grid, "block": [128, 1, 1], "registers per thread": 168, "shared memory": 512,
            "est. achieved occupancy %": 18}  # fmt: skip
    return {"cat": "kernel", "name": name, "dur": dur_us, "args": args}


def test_kernels_grouped_by_name_sorted_by_device_time():
    events = [
        _kernel("_scan_kernel", 100.0, [512, 32, 4]),
        _kernel("_chain_kernel", 900.0, [8, 32, 4]),
        _kernel("_scan_kernel", 300.0, [64, 32, 4]),
        _kernel("_scan_kernel", 50.0, [512, 32, 4]),
        {"cat": "cpu_op", "name": "aten::empty", "dur": 5000.0, "args": {}},  # not a kernel
    ]
    rows = kernel_launches(_TraceStub(events))
    assert [r["name"] for r in rows] == ["_chain_kernel", "_scan_kernel"]
    scan = rows[1]
    assert scan["calls"] == 3
    assert scan["device_ms"] == pytest.approx(0.45)
    assert scan["mean_ms"] == pytest.approx(0.15)
    assert scan["grids"] == [[512, 32, 4], [64, 32, 4]]  # distinct grids, first-seen order
    assert (scan["block"], scan["registers_per_thread"], scan["shared_bytes"]) == ([128, 1, 1], 168, 512)
    assert scan["est_occupancy_pct"] == 18


def test_no_kernels_in_a_cpu_trace():
    assert kernel_launches(_TraceStub([{"cat": "cpu_op", "name": "aten::mm", "dur": 1.0, "args": {}}])) == []
