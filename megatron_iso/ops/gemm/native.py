"""Native linear: what stock stacks do (one library GEMM in the input dtype). Baseline and
performance profile; its reduction order belongs to the BLAS library and may change with M."""

from __future__ import annotations

import torch


def native_linear(x: torch.Tensor, weight: torch.Tensor, leaves: int | None = None) -> torch.Tensor:
    """``x @ weight.T`` in the weight's dtype (as Megatron's F.linear), then upcast to fp32.

    ``leaves`` is accepted for a uniform signature and ignored: the library picks its own order.
    """
    del leaves
    return (x.to(weight.dtype) @ weight.t()).float()
