"""MoE op family: router probabilities, top-k routing, routed combine; one dispatch point.

| device    | profile      | implementation                                                  |
|-----------|--------------|-----------------------------------------------------------------|
| cpu, cuda | correctness  | ``reference`` (elementwise IEEE ops + fixed tree; same on both)  |
| any       | performance  | ``native`` (library softmax / topk / sum)                        |

The router and combine are tiny next to the expert GEMMs (E or k terms per token), so the torch
reference also serves CUDA tensors; without autograd (rollout, scoring) the whole router (:func:`route`), the
slots' expert-major order (:func:`slot_order`) are one Triton launch each on CUDA (``route_triton``, ``slots_triton``;
the torch path's bits) where their shapes allow, and the combine with the shared expert (:func:`combine_slots`) is one
launch forward and one backward, also in training. The expert GEMMs go
through ``ops.gemm.linear``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from megatron_iso.ops.common.autograd import with_fused_backward
from megatron_iso.ops.common.interpret import INTERPRET
from megatron_iso.ops.moe import native, reference
from megatron_iso.ops.moe.backend import RoutingBackend
from megatron_iso.registry import PROFILES, Profile, register_per_device


def _impl(profile: str) -> RoutingBackend:
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not allowed; allowed values: {list(PROFILES)}")
    return reference if profile == Profile.CORRECTNESS else native


def router_probs(logits: torch.Tensor, *, profile: str = Profile.CORRECTNESS) -> torch.Tensor:
    """fp32 softmax over experts of fp32 router logits ``[..., E]``."""
    return _impl(profile).router_probs(logits)


def top_k_route(
    probs: torch.Tensor, k: int, *, normalize: bool, profile: str = Profile.CORRECTNESS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] fp32, experts [N, k] int64)``; correctness: ties to the lowest expert index,
    experts ascending (the combine order)."""
    return _impl(profile).top_k_route(probs, k, normalize=normalize)


def route_weights(
    probs: torch.Tensor, experts: torch.Tensor, *, normalize: bool, profile: str = Profile.CORRECTNESS
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`top_k_route` returns for the experts ``experts [N, k]`` given instead of selected (a replayed
    routing, ``models.routing``): the weights at them (renormalised as there), experts in the combine order."""
    return _impl(profile).route_weights(probs, experts, normalize=normalize)


class Route(NamedTuple):
    """What a router hands its layer: ``scores [N, E]`` (the softmax), the chosen ``experts [N, k]`` (ascending)
    with their fp32 ``weights [N, k]``, and Megatron's ``routing_map [N, E]`` (bool) and ``probs [N, E]`` (the
    weights scattered, zeros elsewhere)."""

    scores: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor
    routing_map: torch.Tensor
    probs: torch.Tensor


def scattered_route(scores: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> Route:
    """The :class:`Route` of ``experts`` and their ``weights`` (Megatron's map and probs scattered from them)."""
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, experts, True)
    probs = torch.zeros_like(scores).scatter(1, experts, weights)
    return Route(scores, weights, experts, routing_map, probs)


def route(logits: torch.Tensor, k: int, *, normalize: bool, profile: str = Profile.CORRECTNESS) -> Route:
    """The router from fp32 ``logits [N, E]``: :func:`router_probs`, :func:`top_k_route` and the scatters. The
    correctness profile without autograd on CUDA is one launch (:mod:`.route_triton`) with the same bits."""
    if profile == Profile.CORRECTNESS and (logits.is_cuda or INTERPRET):
        from megatron_iso.ops.moe import route_triton

        if route_triton.serves(logits, k):
            return Route(*route_triton.route_triton(logits, k, normalize=normalize))
    scores = router_probs(logits, profile=profile)
    weights, experts = top_k_route(scores, k, normalize=normalize, profile=profile)
    return scattered_route(scores, weights, experts)


def slot_order(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)`` of a step's slot expert ids ``flat [S]`` (int64): the stable sort's permutation, which
    lists the slots expert-major (then by token and slot), and its inverse. Integer bookkeeping, no rounding: on
    CUDA one launch for up to ``slots_triton.MAX_SLOTS`` slots, the same permutation."""
    if flat.is_cuda or INTERPRET:
        from megatron_iso.ops.moe import slots_triton

        if slots_triton.serves_order(flat):
            return slots_triton.slot_order_triton(flat)
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, inverse


def slot_order_with_sources(flat: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`slot_order`'s ``(order, inverse)`` and ``order // topk``: the token whose row each expert-major
    position takes (slot ``i`` belongs to token ``i // topk``), for a dispatch that gathers the rows straight from
    the tokens. On CUDA from the order's own launch."""
    if flat.is_cuda or INTERPRET:
        from megatron_iso.ops.moe import slots_triton

        if slots_triton.serves_order(flat):
            return slots_triton.slot_order_triton(flat, topk)
    order, inverse = slot_order(flat)
    return order, inverse, order // topk


def combine_slots(
    expert_out: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    dtype: torch.dtype,
    *,
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """The MoE layer's output ``[N, H]`` in ``dtype``: token n's expert rows ``expert_out[inverse[n k + j]]`` (fp32,
    expert-major ``[S, H]``) combined by :func:`combine_routed`, plus the shared expert's ``[N, H]`` widened to fp32,
    rounded once. On CUDA one launch with the same bits, and under autograd one backward pass
    (``slots_triton.combine_backward_triton``) that keeps no gathered copy of the rows."""
    if profile == Profile.CORRECTNESS and (expert_out.is_cuda or INTERPRET):
        from megatron_iso.ops.moe import slots_triton

        if slots_triton.serves_combine(expert_out, weights, shared, dtype):
            return with_fused_backward(
                slots_triton.combine_triton,
                slots_triton.combine_backward_triton,
                expert_out,
                inverse,
                weights,
                shared,
                dtype,
            )
    n, k = weights.shape
    out = combine_routed(expert_out[inverse].reshape(n, k, -1), weights, profile=profile)
    if shared is not None:
        out = out + shared.reshape(out.shape).float()
    return out.to(dtype)


def combine_routed(
    expert_out: torch.Tensor, weights: torch.Tensor, *, profile: str = Profile.CORRECTNESS
) -> torch.Tensor:
    """fp32 ``sum_k weights[:, k] * expert_out[:, k]`` per token (``expert_out [N, k, H]``)."""
    return _impl(profile).combine_routed(expert_out, weights)


def _probe_inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4242)
    logits = torch.randn(7, 16, generator=g)
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1.0  # a tie: routing must pick expert 3 first
    y = torch.randn(7, 4, 24, generator=g)
    return logits.to(device), y.to(device)


def _probe(mod, device: str) -> dict[str, torch.Tensor]:
    logits, y = _probe_inputs(device)
    if mod is reference:  # the whole router as the layers call it: on CUDA its one-launch kernel
        with torch.no_grad():
            probs, w, e, _, _ = route(logits, 4, normalize=True)
    else:
        probs = mod.router_probs(logits)
        w, e = mod.top_k_route(probs, 4, normalize=True)
    return {"probs": probs, "weights": w, "experts": e, "combine": mod.combine_routed(y, w)}


register_per_device(
    op="moe_route_combine",
    impl_id="moe_route_combine.reference",
    version="1",
    profile=Profile.CORRECTNESS,
    fn=reference.combine_routed,
    constants={
        "router_logits": "fp32 batch-invariant GEMM",
        "softmax": "exact max, iso_exp (fp64 IEEE-composed, one rounding), tree sum",
        "top_k": "stable descending sort: ties to the lowest expert index",
        "combine_order": "ascending expert index",
        "combine": "fp32 products, balanced tree over k, one rounding after the shared expert",
    },
    probe_for=lambda device: functools.partial(_probe, reference, device),
    # What serves the router, the combine and its backward on CUDA: kernels computing the same forward ops.
    fields_for=lambda device: (
        {
            "constants": {
                "router_without_autograd": "route_triton: one launch, exp64 without FMA, div_rn",
                "combine_kernel": "slots_triton: products, tree over k, + shared, one rounding; no FMA",
                "combine_backward": "slots_triton: dy = w * dout; dw over H in blocks then the tree",
            }
        }
        if device == "cuda"
        else {}
    ),
)
register_per_device(
    op="moe_route_combine",
    impl_id="moe_route_combine.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=native.combine_routed,
    constants={"softmax": "torch.softmax", "top_k": "torch.topk", "combine": "library sum"},
    probe_for=lambda device: functools.partial(_probe, native, device),
)

__all__ = [
    "Route",
    "combine_routed",
    "combine_slots",
    "route",
    "route_weights",
    "router_probs",
    "scattered_route",
    "slot_order",
    "top_k_route",
]
