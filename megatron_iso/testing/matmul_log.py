"""What a backward multiplies: a dispatch mode that records every matmul's operand dtypes and every
cast to fp32, so tests can hold the training path to "16-bit operands, no fp32 copies"."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MatmulLog(TorchDispatchMode):
    """Records ``matmul_dtypes`` (operand dtypes per matmul call) and ``fp32_casts`` (source shapes)."""

    MATMULS: ClassVar[frozenset] = frozenset(
        {torch.ops.aten.mm.default, torch.ops.aten.mm.dtype, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    )

    def __init__(self) -> None:
        super().__init__()
        self.matmul_dtypes: list[tuple[torch.dtype, ...]] = []
        self.fp32_casts: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func in self.MATMULS:
            self.matmul_dtypes.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32:
            self.fp32_casts.append(tuple(args[0].shape))
        return func(*args, **kwargs)
