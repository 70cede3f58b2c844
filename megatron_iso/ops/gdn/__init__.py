"""Gated DeltaNet op family: causal conv1d + SiLU, l2norm, gates, and the gated delta rule (CPR).

Dispatch as in ``ops.norm``: CPU+correctness = ``reference`` (CPR: one semantics for training,
prefill and decode), CUDA+correctness = the ``megatron_iso.ops.gdn.triton`` package (lazy),
performance = ``native`` (chunked for training/prefill, recurrent for decode, as stock stacks);
each answers the Protocols of ``backend``.
Per-sequence state lives in :class:`~megatron_iso.ops.gdn.state_cache.GDNStateCache`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_iso.ops.common.dispatch import device_class_of, import_triton_module, runs_triton, select
from megatron_iso.ops.gdn import native, reference  # noqa: F401  (imports register the implementations)
from megatron_iso.ops.gdn.backend import CausalConv1d, GatedDeltaRule, Gates, L2Norm
from megatron_iso.ops.gdn.reference import DEFAULT_CHUNK, L2NORM_EPS
from megatron_iso.ops.gdn.state_cache import OUTPUT_FORMS, GDNLayerState, GDNStateCache
from megatron_iso.registry import Profile, lookup

TRITON_MODULE = "megatron_iso.ops.gdn.triton"
# What a GPU training forward keeps for the backward (rl.gdn_backward_states): "keep" its chunk-form state pass (u, W,
# KD, T^{-1}, entry states: about 49 KB per token and layer at 32 value heads of 128 with bf16 dots, 88 KB with fp32
# storage), or "recompute" it in the backward (the prep and chain kernels again). Gradients are bitwise the same
# either way.
BACKWARD_STATES = ("keep", "recompute")


def check_backward_states(value: str, field: str) -> str:
    """``value`` if it is one of :data:`BACKWARD_STATES`, else a ValueError naming ``field`` and the allowed values
    (the one check, for the op's argument and for the config's ``rl.gdn_backward_states``)."""
    if value not in BACKWARD_STATES:
        raise ValueError(f"{field}={value!r} is not allowed; allowed values: {list(BACKWARD_STATES)}")
    return value


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    profile: str = Profile.CORRECTNESS,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over packed rows ``x [T, Cd]`` with ``weight [Cd, K]``; updates ``conv_state``."""
    fn: CausalConv1d = select("gdn_conv1d", x, profile, TRITON_MODULE)
    return fn(x, weight, cu_seqlens, conv_state=conv_state, slots=slots, starts=starts)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS, *, profile: str = Profile.CORRECTNESS) -> torch.Tensor:
    """fp32 ``x / sqrt(sum(x^2) + eps)`` over the last dim."""
    fn: L2Norm = select("gdn_l2norm", x, profile, TRITON_MODULE)
    return fn(x, eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, profile: str = Profile.CORRECTNESS
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(g, beta) = (-exp(A_log) * softplus(a + dt_bias), sigmoid(b))``."""
    fn: Gates = select("gdn_gates", a, profile, TRITON_MODULE)
    return fn(a, b, A_log, dt_bias)


GDN_FORM_AUTO = "auto"


def gdn_profile_fields(profile: Any, device_class: str) -> tuple[str, str | None]:
    """(profile.gdn_form, profile.gdn_dot_precision) for ``device_class``, checked: the form one of
    :data:`OUTPUT_FORMS` or "auto" (missing: "scan"), the precision null or a string (the GPU kernels check its value
    when they run). "auto" resolves to the fastest form that exists here: "chunk" on the GPU kernels (cuda,
    correctness; at its default bf16 dots the one within issue 8's 1.2x of FLA in training, prefill and decode,
    docs/GDN.md), "scan" elsewhere, the only form there. Callers pin the resolved form, never "auto"."""
    get = profile.get if hasattr(profile, "get") else lambda key, default=None: getattr(profile, key, default)
    form = get("gdn_form", None) or "scan"
    precision = get("gdn_dot_precision", None)
    if form == GDN_FORM_AUTO:
        form = "chunk" if runs_triton(device_class, str(get("name", None))) else "scan"
    if form not in OUTPUT_FORMS:
        raise ValueError(f"profile.gdn_form={form!r} is not allowed; allowed values: {[*OUTPUT_FORMS, GDN_FORM_AUTO]}")
    if precision is not None and not isinstance(precision, str):
        raise ValueError(f"profile.gdn_dot_precision={precision!r} must be null or a string such as 'bf16'")
    return str(form), precision


def gdn_choice_runs_here(form: str, dot_precision: str | None, device_class: str, profile: str) -> bool:
    """Whether a (form, dot precision) choice exists for ``device_class`` and ``profile``: the scan form at the
    implementation's own precision (None) everywhere, anything else only on the GPU kernels (cuda, correctness). The
    one rule behind the op's refusal and the contract builder's."""
    return (form == "scan" and dot_precision is None) or runs_triton(device_class, profile)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    state: GDNLayerState | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    profile: str = Profile.CORRECTNESS,
    form: str = "scan",
    dot_precision: str | None = None,
    backward_states: str = "keep",
) -> torch.Tensor:
    """Gated delta rule over packed sequences (fp32 ``[T, Hv, Dv]``); see ``reference`` for the semantics.

    ``backward_states`` (:data:`BACKWARD_STATES`): memory vs time of the GPU backward; elsewhere autograd of the
    implementation decides what is kept.

    ``form`` and ``dot_precision`` (profile.gdn_form, profile.gdn_dot_precision) choose among the GPU kernels
    (cuda, profile correctness; docs/GDN.md "Output forms"); elsewhere only the scan form at the implementation's own
    precision exists, and anything else is refused rather than ignored."""
    check_backward_states(backward_states, "gated_delta_rule: backward_states (rl.gdn_backward_states)")
    fn: GatedDeltaRule = select("gated_delta_rule", q, profile, TRITON_MODULE)
    device_class = device_class_of(q)
    if not gdn_choice_runs_here(form, dot_precision, device_class, profile):
        raise ValueError(
            f"gated_delta_rule: form={form!r}, dot_precision={dot_precision!r} choose GPU kernels (cuda, profile "
            f"correctness); on {device_class} with profile {str(profile)!r} only form='scan' with dot_precision=None "
            "exists (profile.gdn_form, profile.gdn_dot_precision)"
        )
    gpu = runs_triton(device_class, profile)  # the Triton module takes the choice; others have none
    kw = {"form": form, "dot_precision": dot_precision, "keep_states": backward_states == "keep"} if gpu else {}
    return fn(q, k, v, g, beta, cu_seqlens, scale=scale, chunk=chunk, state=state, slots=slots, starts=starts, **kw)


def _triton_carry(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPU kernels' carried rule (``triton.carry``), imported on first use as the rest of the Triton module."""
    module = import_triton_module(TRITON_MODULE, "gated_delta_rule_carry on cuda with profile=correctness")
    return module.carry.gated_delta_rule_carry(*args, **kwargs)


# The rule's implementations that also run as :func:`gated_delta_rule_carry` (a differentiable entry state in, the
# last chunk boundary's state out), by registered impl_id: the CPU reference and the GPU kernels (both forms, every
# dot precision the plain rule takes). Not the native chunk loop, which is aligned at its call's first row, not at the
# sequence's chunk boundaries.
_CARRY = {"gated_delta_rule.reference": reference.gated_delta_rule_carry, "gated_delta_rule.triton": _triton_carry}
TRITON_RULE_ID = "gated_delta_rule.triton"  # the Triton module's registered impl_id (registered when it is imported)


def carries_state(device_class: str, profile: str, form: str = "scan", dot_precision: str | None = None) -> bool:
    """Whether the rule that runs on ``device_class`` under ``profile`` (with this form and dot precision) has a
    :func:`gated_delta_rule_carry`: context parallelism passes GDN state rank to rank only where it has."""
    if runs_triton(device_class, profile):  # the GPU kernels, not imported here: they may not be loaded yet
        return TRITON_RULE_ID in _CARRY
    if (form, dot_precision) != ("scan", None):
        return False
    return lookup("gated_delta_rule", device_class, profile).impl_id in _CARRY


def gated_delta_rule_carry(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    entry: torch.Tensor,
    *,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    profile: str = Profile.CORRECTNESS,
    form: str = "scan",
    dot_precision: str | None = None,
    backward_states: str = "keep",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule` over sequences that each begin on one of their chunk boundaries with a given entry
    state: ``(out, exit)``, differentiable in ``entry`` too (``reference.gated_delta_rule_carry``: the same bits as
    the plain rule over the uncut sequences, with the same ``form`` and ``dot_precision``). Only where
    :func:`carries_state` holds; elsewhere a ValueError. ``backward_states`` as :func:`gated_delta_rule`'s."""
    check_backward_states(backward_states, "gated_delta_rule_carry: backward_states (rl.gdn_backward_states)")
    device_class = device_class_of(q)
    if not carries_state(device_class, profile, form, dot_precision):
        raise ValueError(
            f"gated_delta_rule_carry: no implementation on {device_class} with profile {str(profile)!r}, form={form!r}, "
            f"dot_precision={dot_precision!r} takes and returns a differentiable state (ops.gdn.carries_state)"
        )
    select("gated_delta_rule", q, profile, TRITON_MODULE)  # on the GPU kernels: imports (so registers) them
    impl = _CARRY[lookup("gated_delta_rule", device_class, profile).impl_id]
    gpu = runs_triton(device_class, profile)
    kw = {"form": form, "dot_precision": dot_precision, "keep_states": backward_states == "keep"} if gpu else {}
    return impl(q, k, v, g, beta, cu_seqlens, entry, scale=scale, chunk=chunk, **kw)


__all__ = [
    "BACKWARD_STATES",
    "DEFAULT_CHUNK",
    "GDN_FORM_AUTO",
    "OUTPUT_FORMS",
    "GDNLayerState",
    "GDNStateCache",
    "carries_state",
    "causal_conv1d",
    "check_backward_states",
    "gated_delta_rule",
    "gated_delta_rule_carry",
    "gdn_choice_runs_here",
    "gdn_gates",
    "gdn_profile_fields",
    "l2norm",
]
