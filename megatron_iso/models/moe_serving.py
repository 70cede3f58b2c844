"""The performance profile's MoE layer in a serving step: a static-shape expert dispatch from stock parts.

Megatron's MoELayer plans its expert batches on the host: its all-to-all dispatcher copies the tokens per expert
to the host and ``SequentialMLP`` splits the rows by them, a sync per layer that also keeps a decode step out of a
CUDA graph. A serving stack runs an MoE layer without any host read instead, and so does :class:`NativeMoELayer`
in a rollout's prefill and decode steps (a model call whose batch has a KV cache: :func:`serving_dispatch`):

1. route: Megatron's router, unchanged (``probs [N, E]``, ``routing_map [N, E]``, top-k on the device);
2. permute: the ``N * k`` (token, expert) slots ordered by expert, then token, as Megatron's ``permute`` orders
   them, found by a stable sort of the transposed routing map instead of ``masked_select`` (whose output size is
   read back); the per-expert counts by a sum on the device;
3. experts: fc1 and fc2 of every local expert as one grouped GEMM launch each (``ops.gemm.grouped_stock``: torch's
   ``grouped_mm``), the activation and the routing weight as Megatron's expert MLP applies them (``per_token_scale``:
   activation in the input dtype, times the fp32 weight, rounded back);
4. combine: Megatron's own ``unpermute`` (a scatter-add into the input dtype), plus the shared expert's output.

Its output is Megatron's MoELayer's up to the library's rounding (the grouped kernel's tiles against one GEMM per
expert); ``tests/models/test_moe_serving.py`` holds it to Megatron's layer within fp32 / bf16 tolerance. Training
forwards (no KV cache) run Megatron's MoELayer as it is, dispatcher included: the trainer stays what a Megatron user
runs. The grouped GEMM needs each projection's weights as one ``[E, N, K]`` tensor while ``SequentialMLP`` holds one
tensor per expert, so the layer keeps a serving copy (:class:`ExpertStack`, as a serving engine keeps its own copy
of the weights), refreshed by ``RolloutEngine.on_weights_updated`` (which every weight change must call anyway) and
released with the rollout's caches between phases (``inference.phase_memory``). EP 1 and expert TP 1 only
(:func:`native_static_unsupported`); elsewhere serving steps run Megatron's layer eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, unpermute

from megatron_iso.models.batch import IsoBatch
from megatron_iso.ops.common.dispatch import select
from megatron_iso.ops.gemm.grouped_stock import OP as GROUPED_STATIC
from megatron_iso.registry import Profile

_SERVING: contextvars.ContextVar[bool] = contextvars.ContextVar("iso_moe_serving", default=False)


@contextlib.contextmanager
def serving_dispatch(batch: object) -> Iterator[None]:
    """Inside, for a serving step (``batch`` an ``IsoBatch`` with a KV cache: the engine's prefill and decode,
    its CUDA-graph buckets included): :class:`NativeMoELayer` takes its static dispatch. Any other call (a trainer
    pack, a batch without a cache) leaves the flag as it is."""
    if not (isinstance(batch, IsoBatch) and batch.uses_cache):
        yield
        return
    token = _SERVING.set(True)
    try:
        yield
    finally:
        _SERVING.reset(token)


def serving_active() -> bool:
    """Whether the calling forward is a serving step (:func:`serving_dispatch`)."""
    return _SERVING.get()


def native_static_unsupported(config) -> str | None:
    """None when :class:`NativeMoELayer` can serve Megatron config ``config`` by the static dispatch; otherwise
    why not (the serving steps then run Megatron's MoELayer, with its host reads)."""
    checks = (
        ("expert_model_parallel_size", config.expert_model_parallel_size != 1, "the all-to-all splits are planned "
         "on the host; allowed: 1"),
        ("expert_tensor_parallel_size", (config.expert_tensor_parallel_size or 1) != 1, "allowed: 1"),
        ("moe_expert_capacity_factor", config.moe_expert_capacity_factor is not None, "token dropping sizes the "
         "expert batches on the host; allowed: None"),
        ("moe_router_padding_for_quantization", config.moe_router_padding_for_quantization, "allowed: False"),
        ("moe_apply_probs_on_input", config.moe_apply_probs_on_input, "allowed: False"),
        ("add_bias_linear", config.add_bias_linear, "expert biases are not stacked; allowed: False"),
        ("use_te_activation_func", config.use_te_activation_func, "allowed: False"),
        ("fp8", bool(config.fp8), "allowed: None"),
        ("fp4", bool(getattr(config, "fp4", None)), "allowed: None"),
        ("moe_latent_size", bool(getattr(config, "moe_latent_size", None)), "allowed: None"),
        ("moe_shared_expert_overlap", config.moe_shared_expert_overlap, "allowed: False"),
    )  # fmt: skip
    for name, bad, why in checks:
        if bad:
            return f"{name}={getattr(config, name)!r}: {why}"
    return None


class ExpertStack:
    """A serving copy of one layer's expert weights: fc1 ``[E, 2F or F, H]`` and fc2 ``[E, H, F]``, the grouped
    GEMM's operands. Built at first use; :meth:`refresh` copies the parameters in again, in place (the tensors keep
    their addresses, so captured decode graphs stay valid); :meth:`tensors` lists them for the phase memory."""

    def __init__(self, experts: torch.nn.Module) -> None:
        self.experts = experts
        self.fc1: torch.Tensor | None = None
        self.fc2: torch.Tensor | None = None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fc1 is None or self.fc2 is None:
            self.refresh()
        return self.fc1, self.fc2

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.fc1, self.fc2) if t is not None]

    @torch.no_grad()
    def refresh(self) -> None:
        for name in ("fc1", "fc2"):
            ws = [getattr(expert, f"linear_{name}").weight for expert in self.experts.local_experts]
            shape = (len(ws), *ws[0].shape)
            stack = getattr(self, name)
            if stack is None or stack.shape != shape or stack.dtype != ws[0].dtype or stack.device != ws[0].device:
                stack = torch.empty(shape, dtype=ws[0].dtype, device=ws[0].device)
                setattr(self, name, stack)
            elif stack.untyped_storage().nbytes() == 0:
                continue  # released between phases (inference.phase_memory): its restore copies the weights in
            torch.stack([w.detach() for w in ws], out=stack)


def _expert_activation(config, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Megatron's expert MLP between its two linears (``MLP.forward`` with ``per_token_scale``, no bias): the
    (gated) activation in ``h``'s dtype, times the fp32 routing weight, rounded back to ``h``'s dtype."""
    if config.gated_linear_unit:
        gate, up = torch.chunk(h, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
        act = config.activation_func(gate) * (up + config.glu_linear_offset)
    else:
        act = config.activation_func(h)
    return (act * probs.unsqueeze(-1)).to(act.dtype)


class NativeMoELayer(MoELayer):
    """Megatron's MoELayer; a serving step takes the static dispatch (module docstring), every other call is
    Megatron's forward unchanged."""

    def __init__(self, config, submodules=None, layer_number: int | None = None, pg_collection=None) -> None:
        # TransformerLayer hands pg_collection only to the exact stock MoELayer class; the default is the same groups.
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.static_unsupported = native_static_unsupported(config)
        self.expert_stack = ExpertStack(self.experts)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if serving_active() and intermediate_tensors is None and self.static_unsupported is None:
            return self.serve(hidden_states), None
        return super().forward(hidden_states, intermediate_tensors, padding_mask=padding_mask)

    def serve(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The static dispatch of ``hidden_states [S, B, H]``: no host read, shapes set by the row count."""
        if self.static_unsupported is not None:
            raise ValueError(f"the static MoE dispatch cannot serve this layer: {self.static_unsupported}")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        n, k = x.shape[0], self.config.moe_router_topk
        shared = self.shared_experts(hidden_states) if self.use_shared_expert else None
        probs, routing_map = self.route(hidden_states)
        torch._assert_async((routing_map.sum(1) == k).all(), f"the router must select moe_router_topk={k} experts")
        # Megatron's permute lists the slots expert-major (masked_select over routing_map.T); a stable descending
        # sort of the same flattened map puts its n * k selected entries first, in that order.
        flat = routing_map.t().reshape(-1).to(torch.uint8)
        slots = torch.sort(flat, descending=True, stable=True).indices[: n * k]
        tokens = slots % n
        slot_probs = probs.t().reshape(-1).index_select(0, slots)
        counts = routing_map.sum(0)
        fc1, fc2 = self.expert_stack.weights()
        grouped = select(GROUPED_STATIC, x, Profile.PERFORMANCE)
        h = grouped(x.index_select(0, tokens), fc1, counts)
        y = grouped(_expert_activation(self.config, h, slot_probs), fc2, counts)
        out = unpermute(y, tokens, restore_shape=x.shape, routing_map=routing_map, fused=False).view(shape)
        return out if shared is None else out + shared


def expert_stacks(model: torch.nn.Module) -> list[ExpertStack]:
    """The serving copies of every :class:`NativeMoELayer` of ``model``."""
    return [m.expert_stack for m in model.modules() if isinstance(m, NativeMoELayer)]


def build_expert_stacks(model: torch.nn.Module) -> None:
    """Build ``model``'s serving copies now, on the current stream (a CUDA-graph capture warms up on a side stream,
    which must not be where tensors that outlive it are allocated)."""
    for stack in expert_stacks(model):
        stack.weights()


def refresh_expert_stacks(model: torch.nn.Module) -> None:
    """Copy ``model``'s expert weights into the serving copies built so far (after a weight change)."""
    for stack in expert_stacks(model):
        if stack.tensors():
            stack.refresh()


__all__ = [
    "ExpertStack",
    "NativeMoELayer",
    "build_expert_stacks",
    "expert_stacks",
    "native_static_unsupported",
    "refresh_expert_stacks",
    "serving_active",
    "serving_dispatch",
]
