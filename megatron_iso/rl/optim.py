"""The trainer's optimizer: Megatron-Core's Adam over the DDP-wrapped policy, and its learning-rate and
weight-decay schedule (Megatron-Core's ``OptimizerParamScheduler``), one scheduler step per RL step.

The schedule is a pure function of the step count, so a resumed run positions it by advancing it to
its first step: the learning rate of every step is the uninterrupted run's.

``rl.use_distributed_optimizer``: Megatron's DistributedOptimizer (ZeRO-1): each data-parallel rank holds the
Adam state and fp32 main weights of its slice of the grad buffer; gradients are reduce-scattered and the
updated weights all-gathered. The update of every element is the same elementwise Adam arithmetic, so only the
global grad norm differs from the replicated optimizer: it is summed from per-slice partial norms over the DP
ranks, another summation order, so with ``rl.grad_clip`` active the clip factor, hence the update, may differ in
its last bits (with clipping off the weights stay the same bits). The run checkpoint stores its sharded state
through Megatron's own ``get_parameter_state_dp_zero`` / ``load_parameter_state_from_dp_zero``
(:mod:`megatron_iso.rl.checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_iso.settings import RLSettings


def build_optimizer(tc: Any, model: torch.nn.Module, rl: RLSettings) -> tuple[Any, Any, Any]:
    """``(ddp, optimizer, schedule)`` for ``model`` under the RL settings ``rl``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = rl.use_distributed_optimizer
    ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    config = OptimizerConfig(
        optimizer="adam",
        use_distributed_optimizer=distributed,
        lr=rl.lr,
        min_lr=rl.min_lr,
        weight_decay=rl.weight_decay,
        clip_grad=rl.grad_clip,
        bf16=tc.bf16,
        params_dtype=tc.params_dtype,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    schedule = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=rl.lr,
        min_lr=rl.min_lr,
        lr_warmup_steps=rl.lr_warmup_steps,
        lr_decay_steps=rl.steps,
        lr_decay_style=rl.lr_decay_style,
        start_wd=rl.weight_decay,
        end_wd=rl.weight_decay,
        wd_incr_steps=rl.steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
    )
    return ddp, optimizer, schedule


def current_lr(optimizer: Any) -> float:
    """The learning rate the next optimizer step applies (the first parameter group's: every group of the
    policy follows the same schedule)."""
    return float(optimizer.param_groups[0]["lr"])


def distributed_parts(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer parts of ``optimizer`` (Megatron chains one per parameter kind); empty when the
    optimizer is replicated (``rl.use_distributed_optimizer=false``)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for p in parts if hasattr(p, "get_parameter_state_dp_zero")]
