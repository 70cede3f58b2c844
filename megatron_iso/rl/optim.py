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
through Megatron's own ``sharded_state_dict`` in the ``fully_reshardable`` form (:mod:`megatron_iso.rl.checkpoint`),
so it resumes at another DP / TP size.

With ``parallel.pp`` > 1 the grad norm (reported, and the clip factor of ``rl.grad_clip``) is the unpipelined
one bit for bit (:func:`join_stage_grad_norms`), so a pipelined run's updates are those of ``parallel.pp=1``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

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
    if tc.pipeline_model_parallel_size > 1 and not distributed:
        join_stage_grad_norms(optimizer)
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


def ensure_adam_state(optimizer: Any) -> None:
    """Give every parameter of the distributed optimizer's parts its Adam state (zeros, step 0) where it has none
    yet, as torch's Adam would on its first step: Megatron's DistributedOptimizer reads the step from that state
    when it builds a state dict (to save or to load into), and without Apex or Transformer Engine it holds none
    before the first step. Zero state is what Adam starts from, so an update after this is the same bits."""
    for part in distributed_parts(optimizer):
        part.init_state_fn(part.optimizer, part.config)
        for state in part.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """Load ``state`` (what ``optimizer.sharded_state_dict`` read back from a checkpoint) into ``optimizer``.

    A replicated optimizer loads it as Megatron's does. For the distributed optimizer the parameter state (Adam's
    tensors and the fp32 main weights, ``fully_reshardable``) is loaded apart from the rest: Megatron's loader copies
    every entry of a parameter's Adam state from the checkpoint, but without Apex or Transformer Engine torch's Adam
    also keeps a ``step`` tensor there, which the checkpoint holds in the param groups instead. The step is set
    aside while the tensors load, then every parameter gets its own copy of it (Megatron hands them one shared
    tensor, which torch's Adam would advance once per parameter)."""
    parts = distributed_parts(optimizer)
    if not parts:
        optimizer.load_state_dict(state)
        return
    chained = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    states = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
    for part, part_state in zip(chained, states, strict=True):
        if part not in parts:
            part.load_state_dict(part_state)
            continue
        part_state = dict(part_state)
        param_state = part_state.pop("param_state")
        kind = part_state.pop("param_state_sharding_type")
        if kind != "fully_reshardable":
            raise ValueError(f"distributed optimizer state of type {kind!r}; this loader reads 'fully_reshardable'")
        part.load_state_dict(part_state)  # param groups and the step, into every parameter's state
        steps = {p: st.pop("step") for p, st in part.optimizer.state.items() if "step" in st}
        try:
            # No autograd: with fp32 weights the main weights are views of the model's parameters, copied in place.
            with torch.no_grad():
                part.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                part.optimizer.state[p]["step"] = step.clone()


def _stage_grad_norms(parts: list[Any]) -> list[list[torch.Tensor]]:
    """Per parameter group (the parts' groups in order), this stage's per-tensor grad norms: the gradients Megatron's
    ``get_main_grads_for_grad_norm`` counts (present, not shared, not a TP duplicate), in the group's order."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    out = []
    for part in parts:
        tp_group = getattr(part, "tp_group", None)
        for group in part.optimizer.param_groups:
            out.append(
                [
                    torch.norm(p.grad)
                    for p in group["params"]
                    if p.grad is not None
                    and param_is_not_shared(p)
                    and tensor_parallel.param_is_not_tensor_parallel_duplicate(p, tp_group)
                ]
            )
    return out


def _joined_grad_norm(parts: list[Any]) -> float:
    """The grad norm of the whole (unpipelined) model as Megatron computes it without Apex or Transformer Engine
    (``local_multi_tensor_l2_norm``: a norm of the per-tensor norms in parameter-group order, squared, summed over
    the TP group, square root). Every group's parameters are the stages' in stage order, so the per-tensor norms
    are gathered from the pipeline stages and put in the unpipelined model's order: the same vector, the same
    bits. (Megatron's own norm sums each stage's partial square over the pipeline instead.)"""
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, [[n.cpu() for n in g] for g in _stage_grad_norms(parts)], group=pp_group)
    joined = [n for g in range(len(stages[0])) for stage in stages for n in stage[g]]
    total = torch.tensor([float(torch.norm(torch.tensor([joined])))], dtype=torch.float) ** 2
    dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    return total.item() ** 0.5


def join_stage_grad_norms(optimizer: Any) -> None:
    """Make ``optimizer`` (a pipeline stage's) compute the unpipelined grad norm (:func:`_joined_grad_norm`) for
    the norm it reports and the clip it applies: Megatron's ``get_grad_norm`` and ``clip_grad_norm`` of every
    part, and the chain's ``get_grad_norm``, replaced on this instance only."""
    from megatron.core.optimizer import optimizer as megatron_optimizer

    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))

    def grad_norm(self: Any) -> float:
        return _joined_grad_norm(parts)

    def clip_grad_norm(self: Any, clip_grad: float) -> float:
        norm = _joined_grad_norm(parts)
        params = self.get_parameters()
        if params:
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                params, clip_grad, norm, self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            )
        return norm

    for target in {id(o): o for o in [optimizer, *parts]}.values():
        target.get_grad_norm = types.MethodType(grad_norm, target)
    for part in parts:
        part.clip_grad_norm = types.MethodType(clip_grad_norm, part)


def scale_moe_aux_loss(tc: Any, device: torch.device, scale: float) -> None:
    """Scale the MoE load-balancing loss's gradient of the next backward by ``scale``.

    Megatron's schedules scale it by 1/micro-batches: each micro-batch's aux loss is a statistic of its own tokens,
    the step's is their mean (so with model.moe_aux_loss_coeff > 0 the micro-batch size changes that term, as in
    Megatron). A filler pass (``Trainer.train_on``) scales it by 0. A no-op for models without experts."""
    if tc.num_moe_experts:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), scale, device=device))


def reset_moe_aux_tracker(*, new_model: bool) -> None:
    """Megatron's process-wide MoE aux-loss tracker (``moe_utils``): emptied for a new model (its per-layer values
    are sized by the first model's depth, so a deeper model built later in the process would index past them),
    zeroed after each step (Megatron's training loop zeroes it when it logs; without that it sums forever)."""
    from megatron.core.transformer.moe import moe_utils

    if new_model:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    else:
        moe_utils.clear_aux_losses_tracker()
