"""kernel_launches: device kernels of a profiler trace grouped by name, with their launch shapes; kernel_span_ms:
the device time they cover."""

from __future__ import annotations

import json

import pytest

from megatron_iso.bench.profiling import kernel_events, kernel_launches, kernel_span_ms


class _TraceStub:
    """Stands in for torch.profiler.profile: exports a fixed Chrome trace (CPU has no kernel events), once, as torch
    does (a second export raises "Trace is already saved")."""

    def __init__(self, events: list[dict]) -> None:
        self.events = events
        self.saved = False

    def export_chrome_trace(self, path: str) -> None:
        if self.saved:
            raise RuntimeError("Trace is already saved.")
        self.saved = True
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events}, f)


def _kernel(name: str, dur_us: float, grid: list[int], ts_us: float = 0.0) -> dict:
    args = {"grid": grid, "block": [128, 1, 1], "registers per thread": 168, "shared memory": 512,
            "est. achieved occupancy %": 18}  # fmt: skip
    return {"cat": "kernel", "name": name, "ts": ts_us, "dur": dur_us, "args": args}


def test_kernels_grouped_by_name_sorted_by_device_time():
    events = [
        _kernel("_scan_kernel", 100.0, [512, 32, 4]),
        _kernel("_chain_kernel", 900.0, [8, 32, 4]),
        _kernel("_scan_kernel", 300.0, [64, 32, 4]),
        _kernel("_scan_kernel", 50.0, [512, 32, 4]),
        {"cat": "cpu_op", "name": "aten::empty", "dur": 5000.0, "args": {}},  # not a kernel
    ]
    rows = kernel_launches(kernel_events(_TraceStub(events)))
    assert [r["name"] for r in rows] == ["_chain_kernel", "_scan_kernel"]
    scan = rows[1]
    assert scan["calls"] == 3
    assert scan["device_ms"] == pytest.approx(0.45)
    assert scan["mean_ms"] == pytest.approx(0.15)
    assert scan["grids"] == [[512, 32, 4], [64, 32, 4]]  # distinct grids, first-seen order
    assert (scan["block"], scan["registers_per_thread"], scan["shared_bytes"]) == ([128, 1, 1], 168, 512)
    assert scan["est_occupancy_pct"] == 18


def test_no_kernels_in_a_cpu_trace():
    cpu_only = _TraceStub([{"cat": "cpu_op", "name": "aten::mm", "dur": 1.0, "args": {}}])
    assert kernel_launches(kernel_events(cpu_only)) == []


def test_span_counts_overlaps_once_and_gaps_not_at_all():
    events = [
        _kernel("_decode_row_kernel", 60.0, [64, 32, 2], ts_us=70.0),  # overlaps the prep (a dependent launch): 70..130
        _kernel("_decode_prep_kernel", 85.0, [64, 32, 1], ts_us=0.0),  # 0..85
        _kernel("_decode_prep_kernel", 85.0, [64, 32, 1], ts_us=200.0),  # after an idle gap: 200..285
        _kernel("_tiny", 5.0, [1, 1, 1], ts_us=210.0),  # wholly inside the one before
        {"cat": "cpu_op", "name": "aten::empty", "ts": 0.0, "dur": 5000.0, "args": {}},  # not a kernel
    ]
    assert kernel_span_ms(kernel_events(_TraceStub(events))) == pytest.approx((130.0 + 85.0) / 1e3)
    # one export serves both (torch refuses a second): back to back, the span is the sum of the durations
    back_to_back = kernel_events(_TraceStub([_kernel("a", 10.0, [1], ts_us=0.0), _kernel("b", 20.0, [1], ts_us=10.0)]))
    assert kernel_span_ms(back_to_back) == pytest.approx(sum(k["device_ms"] for k in kernel_launches(back_to_back)))


def test_a_real_cpu_profile_exports_once_for_both():
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    events = kernel_events(prof)
    assert kernel_launches(events) == [] and kernel_span_ms(events) == 0.0  # a CPU trace has no kernels
    with pytest.raises(RuntimeError, match="already saved"):  # why the list is passed on, not the profile
        kernel_events(prof)
