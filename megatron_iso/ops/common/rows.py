"""Reading the rows of a strided view in place, for one-row-per-program Triton kernels.

The GDN layer's kernels take column slices of the input projection's output (q, k, z, the gates' a and b): a view
``[T, H, D]`` whose tokens are a whole projection row apart. A kernel that maps its program's row ``r`` to element
``(r // H) * token_stride + (r % H) * head_stride`` reads such a view where it lies, instead of a copy made first.
"""

from __future__ import annotations

import torch


def strided_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(x, heads per token, token stride, head stride)`` addressing the rows of ``x``'s last dim in place: a
    ``[T, H, D]`` or ``[T, D]`` view with unit last stride as it is; any other shape or stride made contiguous
    first (then one row per "token")."""
    if x.stride(-1) == 1 and x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    if x.stride(-1) == 1 and x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x.contiguous(), 1, x.shape[-1], 0
