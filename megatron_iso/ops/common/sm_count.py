"""Streaming multiprocessors of a device: an input to schedule choices only (how many programs share a
GEMM tile's leaf tree, whether a decode attention step splits over key segments), never to arithmetic."""

from __future__ import annotations

import functools

import torch

# What the schedules assume off CUDA (the CPU, the Triton interpreter): a schedule input, never arithmetic.
CPU_SM_COUNT = 8


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (:data:`CPU_SM_COUNT` off CUDA), read once per CUDA device."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


__all__ = ["CPU_SM_COUNT", "sm_count"]
