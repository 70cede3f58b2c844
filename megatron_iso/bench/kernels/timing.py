"""What every kernel benchmark shares: CUDA-graph and event timing, the copy bandwidth, seeded inputs (bitwise
comparison: ``megatron_iso.testing.bits.same_bits``)."""

from __future__ import annotations

import torch


def time_ms(fn, rep: int = 40) -> float:
    import triton.testing

    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def time_events_ms(fn, rep: int = 40) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, rep=rep, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written, in GB/s."""
    n = 1 << 29
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    # Events around 20 plain copies (no graph): a graph-replayed copy reads low (2.8 of 4.3 TB/s on an H200).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    ms = min(start.elapsed_time(end) / 20, time_ms(lambda: dst.copy_(src), rep=200))
    return 2 * n * 4 / ms / 1e6


def rand(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)
