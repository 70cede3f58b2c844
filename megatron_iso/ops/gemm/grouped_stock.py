"""Stock grouped GEMM with static shapes: the performance profile's expert GEMMs in a serving step.

``out[rows of e] = x[rows of e] @ weights[e].T`` for rows sorted by expert (``counts[e]`` rows each, the counts
on the device), computed without reading the counts on the host, so a decode step that runs it can be captured in
a CUDA graph. This is what a serving stack runs for an MoE layer: one grouped GEMM launch over all experts.

| operands                                   | implementation                                                      |
|--------------------------------------------|---------------------------------------------------------------------|
| bf16 on CUDA sm90 / sm100                  | ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` before it): ATen's CUTLASS grouped kernel; the offsets are read on the device |
| CPU (torch with a grouped GEMM)            | the same torch op (ATen's per-group loop; on the CPU its offset reads are no device sync) |
| anything else (fp32 on CUDA, older GPUs)   | :func:`masked_dense`: every expert's library GEMM on all rows, each row kept from its own expert (E times the FLOPs) |

Why not torch's op everywhere: on CUDA, outside bf16 on sm90/sm100, ATen's ``_grouped_mm`` falls back to a loop
over groups that copies the offsets to the host (a sync per call, which a CUDA graph cannot capture). Its bits
belong to the library (the grouped kernel's tiles, or the per-expert GEMM's), as for every native op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_iso.registry import Profile, register_per_device

OP = "grouped_gemm_static"
IMPL_ID, VERSION = "grouped_gemm_static.native", "1"
_CUDA_KERNEL_ARCHS = (9, 10)  # compute capability majors whose bf16 grouped_mm is ATen's CUTLASS kernel


def library_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM: ``torch.nn.functional.grouped_mm`` where the installed torch has it, else
    ``torch._grouped_mm`` (torch 2.8 on), else None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def library_kernel_serves(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these operands without reading the offsets on the host: bf16 on a CUDA
    device of compute capability 9.x or 10.x, or any CPU tensors; and the layout it takes (rows of 16-byte
    multiples, 16-byte aligned on CUDA)."""
    if library_grouped_mm() is None or x.dtype != weights.dtype:
        return False
    k = x.shape[1]
    if (k * x.element_size()) % 16:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in _CUDA_KERNEL_ARCHS:
        return False
    return x.data_ptr() % 16 == 0 and weights.data_ptr() % 16 == 0


def masked_dense(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert's library GEMM on all ``T`` rows, each row kept from its own expert (rows ``[start_e, end_e)``
    from the prefix sum of the counts, on the device). No host read; E times the work. Rows past the counts' sum
    stay 0."""
    t = x.shape[0]
    ends = torch.cumsum(counts.to(x.device), 0)
    starts = ends - counts.to(x.device)
    row = torch.arange(t, device=x.device).unsqueeze(1)
    out = x.new_zeros((t, weights.shape[1]))
    for e in range(weights.shape[0]):
        mine = (row >= starts[e]) & (row < ends[e])
        out = torch.where(mine, x @ weights[e].t(), out)
    return out


def grouped_mm_static(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` in ``x``'s dtype: the rows of ``x [T, K]`` (sorted by expert, ``counts[e]`` each, the counts a
    device tensor summing to T) times their expert's ``[N, K]`` slice of ``weights [E, N, K]``, with no host read
    (module docstring: torch's grouped GEMM where it runs so, else :func:`masked_dense`)."""
    if x.dim() != 2 or weights.dim() != 3 or weights.shape[2] != x.shape[1]:
        raise ValueError(
            f"grouped_mm_static: x must be [T, K] and weights [E, N, K] with the same K; got {tuple(x.shape)} and "
            f"{tuple(weights.shape)}"
        )
    if counts.dim() != 1 or counts.numel() != weights.shape[0]:
        raise ValueError(f"grouped_mm_static: counts must be [E={weights.shape[0]}], got {tuple(counts.shape)}")
    if x.dtype != weights.dtype:
        raise TypeError(f"grouped_mm_static: x is {x.dtype} and the weights {weights.dtype}; they must match")
    x = x.contiguous()
    if library_kernel_serves(x, weights):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return library_grouped_mm()(x, weights.transpose(1, 2), offs=offs)
    return masked_dense(x, weights, counts)


def _probe(device: str) -> Callable[[], dict[str, torch.Tensor]]:
    def probe() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(2468)
        x = torch.randn(9, 64, generator=g)
        w = torch.randn(4, 24, 64, generator=g) / 8
        counts = torch.tensor([3, 0, 1, 5], device=device)  # an empty expert and a one-row expert
        return {
            dt: grouped_mm_static(x.to(device, dtype), w.to(device, dtype), counts)
            for dt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        }

    return probe


register_per_device(
    op=OP,
    impl_id=IMPL_ID,
    version=VERSION,
    profile=Profile.PERFORMANCE,
    fn=grouped_mm_static,
    constants={
        "algorithm": "torch grouped_mm (CUTLASS on sm90/sm100 bf16, ATen's loop on CPU); else masked library GEMMs",
        "accumulate": "library",
        "row_order": "sorted by expert, counts per expert on the device",
    },
    cases=("prefill", "decode"),
    probe_for=_probe,
)

__all__ = ["OP", "grouped_mm_static", "library_grouped_mm", "library_kernel_serves", "masked_dense"]
