"""Invariant Megatron parallel linears: drop-in ModuleSpec submodules.

Config attributes read from the :class:`~megatron_iso.parallel.layer_config.IsoTransformerConfig` (required):
- ``iso_leaves`` (int): leaves G of row-parallel GEMMs. A power of two, >= the largest TP ever
  used for this model, dividing the layer's input size. The contract records it.
- ``iso_column_leaves`` (int, default 1): leaves of column-parallel GEMMs. Their K is never split across
  ranks, so batch invariance is all they need; 1 leaf is the cheapest on GPU.
- ``iso_expert_leaves`` (int): leaves of a routed expert's row-parallel (down) projection (``is_expert``).
- ``iso_profile`` ("correctness" | "performance"): "performance" runs stock Megatron forward.

Row-parallel at TP=C: rank i holds K columns [iK/C, (i+1)K/C) = leaves [iG/C, (i+1)G/C). It
computes the fp32 node of the leaf tree over its leaves, the tree collective finishes the tree
(all-reduce, or reduce-scatter of rows with sequence parallel), the bias is added once in fp32,
and the result is rounded once to the input dtype. TP=1,2,4,8 and SP on/off give the same bits.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_iso.ops.gemm import linear, validate_leaves
from megatron_iso.parallel.layer_config import iso_config
from megatron_iso.parallel.tree_collectives import (
    copy_to_tp,
    gather_along,
    gather_rows,
    split_along,
    tree_all_reduce,
    tree_reduce_scatter,
)
from megatron_iso.registry import Profile


def _finish(out_fp32: torch.Tensor, bias: torch.Tensor | None, skip_bias_add: bool, dtype: torch.dtype):
    """Bias added once in fp32 after the tree, one rounding; Megatron's (output, bias) tuple."""
    if bias is not None and not skip_bias_add:
        return (out_fp32 + bias.float()).to(dtype), None
    return out_fp32.to(dtype), bias


def _rounded_linear(
    x: torch.Tensor, weight: torch.Tensor, leaves: int, bias: torch.Tensor | None, skip_bias_add: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_finish(linear(x, weight))`` for a layer whose tree ends on this rank. Without a bias to add the GEMM
    rounds its own output (same bits, no fp32 output tensor, a 16-bit gradient in the backward)."""
    if bias is None or skip_bias_add:
        return linear(x, weight, leaves=leaves, profile=Profile.CORRECTNESS, out_dtype=x.dtype), bias
    return _finish(linear(x, weight, leaves=leaves, profile=Profile.CORRECTNESS), bias, skip_bias_add, x.dtype)


def _check_supported(config, layer: str) -> None:
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError(f"{layer}: defer_embedding_wgrad_compute=True is not supported by the invariant linears")


class LeafTreeColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with a batch-invariant GEMM; the SP all-gather of rows only moves data."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        config = iso_config(config, type(self).__name__)
        self.iso_leaves, self.iso_profile = config.iso_column_leaves, config.iso_profile
        if self.iso_profile == Profile.CORRECTNESS:
            _check_supported(config, type(self).__name__)
            validate_leaves(self.iso_leaves, k=input_size)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.iso_profile == Profile.PERFORMANCE:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied and skip_weight_param_allocation is True")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(
                f"supplied weight's shape is {tuple(weight.shape)}, "
                f"not {(self.output_size_per_partition, self.input_size)} as expected"
            )
        out, out_bias = self.local_output(self.local_input(input_), weight)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            out = gather_along(out, self.tp_group, dim=-1)
        return out, out_bias

    def local_input(self, input_: torch.Tensor) -> torch.Tensor:
        """The rows this rank multiplies: sequence-parallel rows gathered, else the input with the TP
        group's gradient reduction attached (none for expert or grad-reduce-disabled layers)."""
        if self.sequence_parallel and not self.explicit_expert_comm:
            return gather_rows(input_, self.tp_group, dim=0)
        if self.explicit_expert_comm or self.disable_grad_reduce:
            return input_
        return copy_to_tp(input_, self.tp_group)

    def local_output(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's output columns for rows ``x`` (from :meth:`local_input`), rounded once to x's dtype."""
        return _rounded_linear(x, weight, self.iso_leaves, self.bias, self.skip_bias_add)


class LeafTreeRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose TP reduction is the fixed leaf tree (fp32 partials, tree collectives)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        config = iso_config(config, type(self).__name__)
        # A routed expert's down projection is never split across ranks (expert TP is 1): its own
        # leaf count (profile.expert_leaves, default 1) also keeps the leaf depth a whole number of the
        # GPU kernels' K tiles (Qwen3-30B-A3B: 768 / 8 = 96 is not).
        self.iso_leaves = config.iso_expert_leaves if self.is_expert else config.iso_leaves
        self.iso_profile = config.iso_profile
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if self.iso_profile == Profile.CORRECTNESS:
            _check_supported(config, type(self).__name__)
            validate_leaves(self.iso_leaves, k=input_size, tp=tp)
            if self.explicit_expert_comm and tp > 1:
                raise NotImplementedError(
                    f"{type(self).__name__}: expert layer with expert-TP={tp} hands unreduced partials to the "
                    "token dispatcher; use the invariant MoE experts"
                )
        self.iso_local_leaves = self.iso_leaves // tp

    def forward_fp32(self, input_: torch.Tensor) -> torch.Tensor:
        """The finished fp32 tree (no bias, not rounded), for callers that add further fp32 terms
        before their own single rounding (the MoE combine adds expert and shared-expert outputs)."""
        x = input_ if self.input_is_parallel else split_along(input_, self.tp_group, dim=-1)
        # fp32 node of the global tree over this rank's leaves; never rounded before the tree ends.
        partial = linear(x, self.weight, leaves=self.iso_local_leaves, profile=Profile.CORRECTNESS)
        if self.sequence_parallel:
            return tree_reduce_scatter(partial, self.tp_group, dim=0)
        return tree_all_reduce(partial, self.tp_group)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.iso_profile == Profile.PERFORMANCE:
            return super().forward(input_)
        if self.iso_local_leaves == self.iso_leaves:  # one rank holds the whole tree: nothing to reduce
            x = input_ if self.input_is_parallel else split_along(input_, self.tp_group, dim=-1)
            return _rounded_linear(x, self.weight, self.iso_leaves, self.bias, self.skip_bias_add)
        return _finish(self.forward_fp32(input_), self.bias, self.skip_bias_add, input_.dtype)
