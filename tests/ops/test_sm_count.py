"""The one SM-count helper the GEMM and attention schedules read (a schedule input, never arithmetic)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_iso.ops.common import sm_count as sc


def test_cpu_devices_get_the_fixed_count() -> None:
    assert sc.sm_count(torch.device("cpu")) == sc.CPU_SM_COUNT == 8


def test_cuda_count_is_read_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []

    def props(index: int) -> SimpleNamespace:
        reads.append(index)
        return SimpleNamespace(multi_processor_count=132 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    sc._cuda_sm_count.cache_clear()
    try:
        assert sc.sm_count(torch.device("cuda", 0)) == 132
        assert sc.sm_count(torch.device("cuda")) == 133  # no index: the current device
        assert sc.sm_count(torch.device("cuda", 1)) == 133
        assert sc.sm_count(torch.device("cuda", 0)) == 132
        assert reads == [0, 1]
    finally:
        sc._cuda_sm_count.cache_clear()  # never leave the fake's counts behind
