"""Mixture-of-experts modules for the correctness profile, plugged into Megatron's ``MoELayer``.

The module tree is Megatron's (``mlp.router``, ``mlp.experts.local_experts.{i}.linear_fc1/fc2``,
``mlp.shared_experts.linear_fc1/fc2/gate_weight``), so checkpoints map the same way for both
profiles. What the correctness profile changes, and why each piece keeps a token's result a
function of that token alone (EP, TP+SP and batch invariance):

- :class:`IsoTopKRouter`: fp32 logits from the batch-invariant GEMM; softmax, top-k (ties to the
  lowest expert index) and renormalisation by ``ops.moe``; Megatron's load-balancing aux loss.
- :class:`IsoSequentialExperts`: per-expert SwiGLU whose GEMMs are row independent (so an expert's
  result for a token does not depend on how many tokens it received); the down projection stays
  fp32 until the combine. On CUDA both projections of all local experts run as one grouped
  leaf-tree GEMM launch each (``ops.gemm.grouped``), bit for bit the per-expert loop's result.
- :class:`IsoSharedExpertMLP`: the shared expert (optionally sigmoid-gated, Qwen3-Next), fp32 out.
- :class:`IsoAlltoAllTokenDispatcher`: all-to-all over EP that only moves rows; the combine is per
  token, in routing order (ascending expert index), fp32 products and the fixed tree.
- :class:`IsoMoELayer`: adds the shared expert's fp32 output to the routed fp32 sum at one place
  and rounds once.

Expert tensor parallelism (``expert_tensor_parallel_size``) must be 1: an expert lives whole on
one EP rank (attention TP and SP are unaffected).

Static shapes (:func:`static_shapes`; a model call whose ``IsoBatch.static_shapes`` is set runs inside
it): the forward reads nothing on the host and its work and shapes depend only on the row count, so a
decode step can be captured in a CUDA graph. EP 1 only. Dispatch takes each token's experts from the
routing map by a sort instead of ``nonzero``, the per-expert counts by a sum on the device, and skips
the all-to-all (the identity at EP 1); the experts run as the grouped GEMM on every device (its
static-shape path, ``ops.gemm.grouped``). The slots are ordered as in the eager dispatch and the combine
is the same, so a row's result is the eager one bit for bit, whatever the other rows (padding rows
included) are. The trainer's forward takes it too at EP 1 (``rl.pipeline.pack_micro_batch``): the backward
is the grouped GEMM's per-expert one, which needs the counts on the host; every model call runs inside
``ops.gemm.grouped.counts_read_once``, so the backward takes them from one copy per forward instead of one
sync per expert GEMM. Activation recompute (``rl.recompute_granularity=full``) reruns whole layers in the
backward, outside the model call: :class:`IsoMoETransformerLayer` re-enters the static path there from its batch
(:func:`recomputed_static_shapes`), and the recomputed expert GEMMs take their counts from the training forward's
copy (kept on the batch), so a recomputing step reads on the host what a plain one reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch
from megatron.core.tensor_parallel.mappings import all_to_all
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, sort_chunks_by_idxs
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_iso.models.batch import IsoBatch
from megatron_iso.models.moe_serving import serving_active, serving_dispatch
from megatron_iso.models.routing import moe_layer_index, routed_experts, routing_scope
from megatron_iso.ops.activation import swiglu_packed
from megatron_iso.ops.common.ieee_math import iso_sigmoid
from megatron_iso.ops.gemm import linear
from megatron_iso.ops.gemm.grouped import counts_read_once, counts_replayed, grouped_linear
from megatron_iso.ops.moe import (
    combine_slots,
    route,
    route_weights,
    scattered_route,
    slot_order,
    slot_order_with_sources,
)
from megatron_iso.parallel.layer_config import iso_config
from megatron_iso.parallel.layers import LeafTreeColumnParallelLinear, LeafTreeRowParallelLinear
from megatron_iso.registry import Profile

_STATIC_SHAPES: contextvars.ContextVar[bool] = contextvars.ContextVar("iso_moe_static_shapes", default=False)


# IsoBatch.memo key: a training forward's expert counts (ops.gemm.grouped.HostCounts), for its recomputed layers.
_FORWARD_COUNTS = "moe_forward_counts"


@contextlib.contextmanager
def static_shapes(enabled: bool = True, *, recompute_batch: IsoBatch | None = None) -> Iterator[None]:
    """Inside, when ``enabled``: MoE layers of the correctness profile take their static-shape forward (no host
    reads, EP 1; the module docstring). ``IsoGPTModel.forward`` enters it for every call, enabled for a batch
    with ``static_shapes`` set. Either way the grouped expert GEMMs of the call read their counts for the
    backward in one copy at its end (``ops.gemm.grouped.counts_read_once``). ``recompute_batch`` (a training
    forward's batch, whose layers activation recompute may rerun): the copy also holds the counts of the calls
    made without autograd and is kept on the batch, for :func:`recomputed_static_shapes`."""
    token = _STATIC_SHAPES.set(bool(enabled))
    try:
        with counts_read_once(keep_no_grad=recompute_batch is not None) as counts:
            if recompute_batch is not None:
                recompute_batch.memo[_FORWARD_COUNTS] = counts
            yield
    finally:
        _STATIC_SHAPES.reset(token)


@contextlib.contextmanager
def recomputed_static_shapes(batch: object) -> Iterator[None]:
    """A layer's forward with a ``static_shapes`` batch outside its model call's :func:`static_shapes` (activation
    recompute reruns it in the backward, perhaps on another thread): the static path again, each expert GEMM
    taking its counts from the model call's copy (``ops.gemm.grouped.counts_replayed``). Nothing to do inside the
    model call or for another batch."""
    if not (isinstance(batch, IsoBatch) and batch.static_shapes) or static_shapes_active():
        yield
        return
    token = _STATIC_SHAPES.set(True)
    try:
        first = batch.memo.get(_FORWARD_COUNTS)
        with counts_replayed(first) if first is not None else counts_read_once():
            yield
    finally:
        _STATIC_SHAPES.reset(token)


def static_shapes_active() -> bool:
    """Whether the calling forward runs inside :func:`static_shapes`."""
    return _STATIC_SHAPES.get()


def _routed_experts(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, k]``: the experts a row of ``routing_map [N, E]`` selects, ascending (what ``nonzero`` lists),
    without a host read: a stable descending sort of the map puts a row's k selected experts first, in
    index order. Every row must select exactly k (the router's top-k does; checked on the device)."""
    torch._assert_async(
        (routing_map.sum(1) == k).all(), f"routing_map must select exactly moe_router_topk={k} experts per token"
    )
    return torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]


def _mlp_fp32(mlp, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP (Megatron ``MLP`` submodules) with its fp32 down projection left unrounded."""
    h, _ = mlp.linear_fc1(x)
    return mlp.linear_fc2.forward_fp32(swiglu_packed(h, profile=Profile.CORRECTNESS))


@dataclasses.dataclass
class RoutedTokens:
    """What :class:`IsoTopKRouter` routed: Megatron's ``(routing_map, probs)`` pair and the ``experts [N, k]``
    (ascending per row) and fp32 ``weights [N, k]`` they were scattered from."""

    routing_map: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


class IsoTopKRouter(TopKRouter):
    """TopKRouter with invariant gating and routing; returns Megatron's ``(probs [N, E], routing_map)``.

    ``probs`` holds the (optionally renormalised) top-k weights in fp32 and zeros elsewhere.
    ``norm_topk_prob`` is Megatron's ``moe_router_pre_softmax=False`` (softmax of the top-k logits
    equals the renormalised top-k probabilities); only ``score_function='softmax'`` is supported.
    """

    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if self.score_function != "softmax":
            raise ValueError(
                f"moe_router_score_function={self.score_function!r} is not supported by IsoTopKRouter; "
                "allowed values: ['softmax']"
            )
        for name in ("moe_router_num_groups", "moe_expert_capacity_factor", "moe_input_jitter_eps"):
            if getattr(config, name, None):
                raise ValueError(f"{name}={getattr(config, name)!r} is not supported by IsoTopKRouter; use None")
        if self.enable_expert_bias:
            raise ValueError("moe_router_enable_expert_bias=True is not supported by IsoTopKRouter; use False")
        self.normalize = not config.moe_router_pre_softmax

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, leaves=1, profile=Profile.CORRECTNESS)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        logits = logits.reshape(-1, self.config.num_moe_experts)
        scores, weights, experts, routing_map, probs = route(logits, self.topk, normalize=self.normalize)
        used = routed_experts(experts)  # recorded in a rollout; compared, perhaps replayed, in training
        if used is not experts:
            _, weights, experts, routing_map, probs = scattered_route(
                scores, *route_weights(scores, used, normalize=self.normalize)
            )
        # The dispatcher of the same layer reads (experts, weights) from here instead of recovering them from
        # routing_map and probs (a sort, a device check and a gather per layer): the same values, fewer kernels.
        self.last_route = RoutedTokens(routing_map, probs, experts, weights)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            # Megatron's switch load-balancing loss: an identity forward, a gradient added backward.
            probs = self._apply_aux_loss(probs, scores, routing_map, with_padding_mask=padding_mask is not None)
        return probs, routing_map

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        return self.routing(self.gating(input), padding_mask=padding_mask)


class _ReplayHook:
    """Megatron's ``router_replay`` slot of ``TopKRouter`` (``moe_utils.topk_routing_with_score_function`` asks it
    for the top-k) filled with :func:`models.routing.routed_experts`: the stock router's own top-k, recorded,
    compared or replayed as the layer's batch says; a replayed row's scores are gathered at the recorded experts,
    so the gate is still computed from the trainer's logits."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, top = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        used = routed_experts(top)
        return (probs, top) if used is top else (scores.gather(1, used), used)


class ReplayTopKRouter(TopKRouter):
    """The performance profile's router: Megatron's ``TopKRouter`` unchanged but for routing replay (R3)."""

    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if config.moe_router_fusion:
            raise ValueError("moe_router_fusion=True bypasses the routing record and replay; use False")
        self.router_replay = _ReplayHook()


class IsoSequentialExperts(SequentialMLP):
    """This rank's experts (Megatron's ``local_experts`` list); fp32 outputs, routing weights not applied.

    Each expert's GEMMs are row independent, so the rows an expert receives, and their number, do
    not change any row's result. The routing weight multiplies in the combine instead of inside the
    expert (Megatron's ``per_token_scale``), so it is applied once, in fp32.
    """

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None) -> None:
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if self.tp_group is not None and self.tp_group.size() > 1:
            raise ValueError(
                f"expert_tensor_parallel_size={self.tp_group.size()} is not supported by the invariant experts; "
                "allowed values: [1]"
            )

    # On CUDA, run fc1 and fc2 of all local experts as one grouped GEMM each (no per-expert launches, no
    # host sync on the counts). False keeps the per-expert loop (benchmarks and tests compare the two).
    grouped_on_cuda: bool = True

    def _can_group(self, tokens: torch.Tensor) -> bool:
        return self.grouped_on_cuda and tokens.is_cuda and self._groupable()

    def _groupable(self) -> bool:
        """Whether the grouped launches compute what the per-expert modules compute (any device)."""
        if len(self.local_experts) == 0:
            return False
        for expert in self.local_experts:
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            if not (isinstance(fc1, LeafTreeColumnParallelLinear) and isinstance(fc2, LeafTreeRowParallelLinear)):
                return False
            if fc1.iso_profile != Profile.CORRECTNESS or fc2.iso_profile != Profile.CORRECTNESS:
                return False
            # fc1's bias is added by its _finish (fc2's forward_fp32 never adds one): keep that path as it is.
            if fc1.bias is not None and not fc1.skip_bias_add:
                return False
        return True

    def _grouped_fp32(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, *, static: bool = False
    ) -> torch.Tensor:
        """What the per-expert loop computes, as two grouped launches. fc1: fp32 tree rounded once to the
        input dtype (the column linear's ``_finish`` without bias); fc2: the fp32 tree over the expert's
        local leaves (expert TP is 1, so the tree collective is the identity). ``static``: the grouped
        GEMM's static-shape path (no host read of the counts)."""
        counts = tokens_per_expert.to(tokens.device, non_blocking=True)
        # A serving step's counts are the column sums of the routing map this step's router built (k distinct
        # experts per row): the GEMMs skip their device check of them. Trainer packs, whose routing may be replayed
        # from a record, keep it.
        check = not serving_active()
        fc1 = [expert.linear_fc1 for expert in self.local_experts]
        fc2 = [expert.linear_fc2 for expert in self.local_experts]
        h = grouped_linear(
            tokens,
            [m.weight for m in fc1],
            counts,
            leaves=fc1[0].iso_leaves,
            profile=Profile.CORRECTNESS,
            static=static,
            check_counts=check,
        )
        act = swiglu_packed(h.to(tokens.dtype), profile=Profile.CORRECTNESS)
        return grouped_linear(
            act,
            [m.weight for m in fc2],
            counts,
            leaves=fc2[0].iso_local_leaves,
            profile=Profile.CORRECTNESS,
            static=static,
            check_counts=check,
        )

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs=None):
        if static_shapes_active():
            # The per-expert loop splits the rows on the host: static shapes need the grouped launches.
            if not self._groupable():
                raise ValueError(
                    "static_shapes needs the grouped expert path: correctness-profile LeafTree linears, "
                    "no fc1 bias added in the linear (skip_bias_add=True or bias=False)"
                )
            if tokens.is_cuda and not self.grouped_on_cuda:
                raise ValueError("static_shapes needs IsoSequentialExperts.grouped_on_cuda=True on CUDA")
            return self._grouped_fp32(tokens, tokens_per_expert, static=True), None
        if self._can_group(tokens):
            return self._grouped_fp32(tokens, tokens_per_expert), None
        chunks = torch.split(tokens, [int(n) for n in tokens_per_expert.tolist()])
        outs = [_mlp_fp32(expert, chunk) for expert, chunk in zip(self.local_experts, chunks, strict=True)]
        return torch.cat(outs, dim=0), None


class IsoSharedExpertMLP(SharedExpertMLP):
    """Shared expert with fp32 output; the Qwen3-Next gate ``sigmoid(x . g)`` is applied in fp32."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = _mlp_fp32(self, hidden_states)
        if self.use_shared_expert_gate:
            gate = iso_sigmoid(linear(hidden_states, self.gate_weight, leaves=1, profile=Profile.CORRECTNESS))
            out = out * gate
        return out


class IsoAlltoAllTokenDispatcher(MoETokenDispatcher):
    """All-to-all over EP that moves rows only; combine per token in routing order, fp32.

    A token's k (token, expert) slots are listed in ascending expert index. Dispatch orders the
    slots by expert (a stable sort: then by token and slot), sends each EP rank the slots of its
    experts, and regroups the received rows by local expert. Combine reverses every move, puts each
    output back in its slot and sums ``weight * output`` over the slots with the fixed tree. The
    only arithmetic is per token, so neither the EP size nor the other tokens can change a bit.

    Under :func:`static_shapes` (EP 1) the same slots in the same order, found without host reads: the
    all-to-alls and the regrouping are identities at EP 1, so no split sizes are needed.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise ValueError(
                f"expert_tensor_parallel_size={self.tp_size} is not supported by IsoAlltoAllTokenDispatcher; "
                "allowed values: [1]"
            )
        self.num_local_experts = num_local_experts
        self.num_experts = config.num_moe_experts
        self.router: torch.nn.Module | None = None  # the layer's router (IsoMoELayer sets it): its RoutedTokens
        self.topk = config.moe_router_topk
        chunks = torch.arange(self.ep_size * num_local_experts)
        # Received chunks come as [source rank, local expert]; experts want [local expert, source rank].
        self.by_expert = chunks.reshape(self.ep_size, num_local_experts).T.ravel()
        self.by_source = chunks.reshape(num_local_experts, self.ep_size).T.ravel()

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        self.hidden_dtype = hidden_states.dtype
        x = hidden_states.reshape(-1, self.hidden_shape[-1])
        n = x.shape[0]
        static = static_shapes_active()
        if static and self.ep_size > 1:
            raise ValueError(
                f"static_shapes needs expert_model_parallel_size=1, got {self.ep_size}: the all-to-all splits "
                "are planned on the host"
            )
        route = None
        if self.router is not None:
            route, self.router.last_route = getattr(self.router, "last_route", None), None
        if route is not None and route.routing_map is routing_map and route.probs is probs:
            # This layer's router made these tensors (probs untouched by the aux loss's autograd hook, whose
            # gradient needs probs itself): its experts and weights are what the branches below would recover.
            experts, self.weights = route.experts, route.weights.float()
        else:
            if static:
                experts = _routed_experts(routing_map, self.topk)
            else:
                # nonzero() lists (token, expert) in row-major order: per token, ascending expert index.
                experts = routing_map.nonzero()[:, 1]
                if experts.numel() != n * self.topk:
                    raise ValueError(f"routing_map must select exactly moe_router_topk={self.topk} experts per token")
                experts = experts.reshape(n, self.topk)
            self.weights = probs.gather(1, experts).float()
        flat = experts.reshape(-1)
        # Without a gradient (a serving step) the rows come straight from the tokens, the slots' sources from the
        # order's launch; under autograd each slot copies its token first, so the backward sums the k copies'
        # gradients in a fixed order (an index_select's backward would scatter-add them).
        gather = not (torch.is_grad_enabled() and hidden_states.requires_grad)
        if gather:
            self.order, self.inverse, sources = slot_order_with_sources(flat, self.topk)
        else:
            self.order, self.inverse = slot_order(flat)
        if static:
            # received[0, l]: rows for local expert l (EP 1: all of them); the all-to-alls pass rows through.
            self.received = routing_map.sum(0).reshape(1, self.num_local_experts)
            self.input_splits = self.output_splits = None
        else:
            counts = torch.bincount(flat, minlength=self.num_experts)
            self.input_splits = counts.reshape(self.ep_size, self.num_local_experts).sum(1).tolist()
            # received[j, l]: rows for my local expert l coming from EP rank j
            self.received = all_to_all(self.ep_group, counts).reshape(self.ep_size, self.num_local_experts)
            self.output_splits = self.received.sum(1).tolist()
        if gather:
            return x.index_select(0, sources), None
        # Each slot gets its own copy of the token row (expand: backward sums the k copies' grads).
        slots = x.unsqueeze(1).expand(n, self.topk, x.shape[1]).reshape(n * self.topk, x.shape[1])
        return slots[self.order], None

    def token_dispatch(self, hidden_states: torch.Tensor, probs):
        return all_to_all(self.ep_group, hidden_states, self.output_splits, self.input_splits), probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs):
        # At EP 1 the chunks already come as [local expert] (by_expert is the identity): nothing to move.
        if self.num_local_experts > 1 and self.ep_size > 1:
            hidden_states, _ = sort_chunks_by_idxs(hidden_states, self.received.ravel(), self.by_expert)
        # One EP rank: the counts are the single row as it is (no reduction launched).
        counts = self.received[0] if self.ep_size == 1 else self.received.sum(0)
        return hidden_states, counts, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.num_local_experts > 1 and self.ep_size > 1:
            hidden_states, _ = sort_chunks_by_idxs(hidden_states, self.received.T.ravel(), self.by_source)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 routed sum ``[..., H]`` (not rounded: the layer adds the shared expert first); Megatron's hook, which
        :class:`IsoMoELayer` replaces by :meth:`combine_with_shared`. The same combine, kept in fp32."""
        return combine_slots(hidden_states, self.inverse, self.weights, None, torch.float32).reshape(self.hidden_shape)

    def combine_with_shared(self, hidden_states: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The layer's output: the routed sum plus the shared expert's fp32 output, rounded once to the input dtype
        (``ops.moe.combine_slots``; what ``combine_postprocess`` + the add + the cast compute)."""
        out = combine_slots(hidden_states, self.inverse, self.weights, shared, self.hidden_dtype)
        return out.reshape(self.hidden_shape)


class IsoMoELayer(MoELayer):
    """Megatron's MoELayer; the correctness profile swaps in the invariant dispatcher and rounds once.

    Output = round(routed fp32 sum + shared expert fp32), the shared expert added in exactly this
    place. The performance profile is Megatron's MoELayer unchanged.
    """

    def __init__(self, config, submodules=None, layer_number: int | None = None, pg_collection=None) -> None:
        # TransformerLayer hands pg_collection only to the exact stock MoELayer class; the default is the same groups.
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.iso = iso_config(config, type(self).__name__).iso_profile == Profile.CORRECTNESS
        if self.iso:
            if config.moe_shared_expert_overlap:
                raise ValueError("moe_shared_expert_overlap=True is not supported by IsoMoELayer; use False")
            self.token_dispatcher = IsoAlltoAllTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection
            )
            self.token_dispatcher.router = self.router

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None) -> torch.Tensor:
        if not self.iso:
            return super().postprocess(output, shared_expert_output)
        return self.token_dispatcher.combine_with_shared(output, shared_expert_output)


class IsoMoETransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer for layers with an MoE MLP: a forward outside the model call (activation
    recompute) runs under :func:`recomputed_static_shapes`, so its experts take the model call's path; every forward
    opens the layer's routing scope (``models.routing``: record, compare, replay); a serving step's forward (a batch
    with a KV cache) runs the performance profile's static dispatch (``models.moe_serving``)."""

    def forward(self, *args, packed_seq_params=None, **kwargs):
        with (
            recomputed_static_shapes(packed_seq_params),
            routing_scope(moe_layer_index(self), packed_seq_params),
            serving_dispatch(packed_seq_params),
        ):
            return super().forward(*args, packed_seq_params=packed_seq_params, **kwargs)
