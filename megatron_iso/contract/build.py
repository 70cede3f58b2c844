"""Build a :class:`Contract` from resolved settings and the op registry, validating it on the way.

Every check here is one that, if skipped, lets a run start whose claims are false (e.g. a TP size
outside the leaves' reach silently changes the reduction tree). Errors name the config field and
the allowed values so the fix is obvious from the message.

The builder reads resolved values (:class:`ContractInputs`): the device class and the GDN form are resolved
above it, by :mod:`megatron_iso.settings` (which may ask the op families; this package, the bottom layer the
ops register into, never imports them). :func:`megatron_iso.settings.contract_for` is the one way from a config
to a contract.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_iso import registry
from megatron_iso.contract.canonical import to_canonical
from megatron_iso.contract.schema import (
    CASE_SIDES,
    AxisClaim,
    CaseSpec,
    Claims,
    CompositionEntry,
    Contract,
    Deployment,
    InvalidationRule,
    NumericalPolicy,
    Semantic,
)
from megatron_iso.errors import UserError
from megatron_iso.registry import CASES, OpImpl, Profile

# Axes whose value never enters a row's arithmetic: replicas see disjoint rows.
# Axes that change where a computation runs, not what it computes: DP replicas score disjoint rows; pipeline
# stages run disjoint layers of one forward in its order, handing the hidden states on unchanged.
NEUTRAL_AXES = ("dp", "pp")
# Model keys that identify the model rather than describe its arithmetic.
MODEL_IDENTITY_KEYS = ("name", "family")
# Model keys that say where the weights start from: neither the model nor its arithmetic (not in the contract).
MODEL_SOURCE_KEYS = ("init_from",)
DEFAULT_MAX_BATCH = 64
# State that depends on the weights; keeping any of it across a weight sync would mix two policies' outputs.
DEFAULT_INVALIDATION = (
    InvalidationRule("prefix_cache", "weight_sync"),
    InvalidationRule("kv_cache", "weight_sync"),
    InvalidationRule("recurrent_state", "weight_sync"),
)


class ContractValidationError(UserError, ValueError):
    """The config and registry do not form a valid contract; the message names the field."""


@dataclass(frozen=True)
class ContractInputs:
    """What the builder reads, resolved: the device class (never "auto"), the profile with its GDN form resolved
    (never "auto"), and the plain model, parallel and contract groups. :mod:`megatron_iso.settings` fills it, once
    the whole config has passed its checks (``settings.check_config``: the parallel degrees among them).

    ``shardable``: per axis Megatron shards the model by (tp, ep), the degrees of the profile's invariance domain
    it can shard this model at (``settings.parallel.shard_degrees``, the one sharding rule); the claims' domains
    keep only those."""

    device_class: str
    profile: Mapping[str, Any]
    model: Mapping[str, Any]
    parallel: Mapping[str, Any]
    shardable: Mapping[str, Sequence[int]]
    contract: Mapping[str, Any] = field(default_factory=dict)


def _device_name(device_class: str) -> str:
    if device_class == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
        return "cuda (not visible to this process)"
    return f"cpu:{platform.machine() or 'unknown'}"


def row_parallel_ks(model: Mapping[str, Any]) -> dict[str, int]:
    """Contraction sizes that are cut into leaves (row-parallel GEMMs, SP reduce, vocab log-sum-exp)."""
    ks: dict[str, int] = {}
    # Not moe_ffn_hidden_size: routed experts are never tensor-parallel; profile.expert_leaves cuts it.
    for key in ("hidden_size", "ffn_hidden_size", "shared_expert_ffn_hidden_size"):
        if isinstance(model.get(key), int):
            ks[f"model.{key}"] = model[key]
    if isinstance(model.get("num_attention_heads"), int) and isinstance(model.get("kv_channels"), int):
        ks["model.num_attention_heads*model.kv_channels"] = model["num_attention_heads"] * model["kv_channels"]
    # Gated DeltaNet output projection contracts over value heads x value head dim.
    if isinstance(model.get("linear_num_value_heads"), int) and isinstance(model.get("linear_value_head_dim"), int):
        ks["model.linear_num_value_heads*model.linear_value_head_dim"] = (
            model["linear_num_value_heads"] * model["linear_value_head_dim"]
        )
    if isinstance(model.get("vocab_size"), int):
        ks["model.vocab_size"] = model["vocab_size"]
    return ks


def check_gpu_gemm_shapes(inputs: ContractInputs, block_k_of: Mapping[str, int]) -> None:
    """Refuse, before anything is built, a correctness-profile run on CUDA whose GEMM shapes the Triton
    leaf-tree kernels cannot walk: each leaf is read in whole K tiles, so every GEMM's K / leaves must be a
    multiple of the BLOCK_K of the model's dtype (row-parallel: profile.leaves; experts' down projection:
    profile.expert_leaves; column-parallel, whose K is the hidden size: one leaf). A capability of the GPU
    kernels, not a policy: the contract itself does not depend on it. No-op for other profiles.
    ``block_k_of``: the GEMM kernels' K tile per dtype (the GEMM family's constant, passed in by
    :mod:`megatron_iso.settings`: the contract layer imports no op family)."""
    profile, model = inputs.profile, inputs.model
    if profile.get("name") != Profile.CORRECTNESS:
        return

    dtype = str(model.get("params_dtype", "fp32"))
    block_k = block_k_of.get(dtype)
    if block_k is None:
        raise ContractValidationError(
            f"model.params_dtype={dtype!r} has no GPU GEMM; allowed values: {sorted(block_k_of)}"
        )
    # Row-parallel GEMM contractions only: hidden_size (an SP reduction size) and the vocab are no GEMM's K here.
    not_gemm = ("model.vocab_size", "model.hidden_size")
    depths: dict[str, tuple[int, int]] = {
        name: (k, profile["leaves"]) for name, k in row_parallel_ks(model).items() if name not in not_gemm
    }
    if isinstance(model.get("hidden_size"), int):
        depths["model.hidden_size (column-parallel K)"] = (model["hidden_size"], 1)
    if isinstance(model.get("moe_ffn_hidden_size"), int) and model.get("num_experts"):
        depths["model.moe_ffn_hidden_size"] = (model["moe_ffn_hidden_size"], profile.get("expert_leaves", 1))
    for name, (k, leaves) in depths.items():
        if (k // leaves) % block_k:
            raise ContractValidationError(
                f"device=cuda: {name}={k} over {leaves} leaves gives leaf depth {k // leaves}, not a multiple of the "
                f"{dtype} GEMM's K tile {block_k}; use sizes whose K / leaves is a multiple of {block_k} "
                "(or fewer leaves)"
            )


def _axis_claims(
    profile: Mapping[str, Any],
    parallel: Mapping[str, Any],
    max_batch: int,
    shardable: Mapping[str, Sequence[int]],
) -> list[AxisClaim]:
    """Per-axis claims. Invariant and neutral axes keep their actual value out of the policy (deployment).
    An invariance domain is narrowed to the degrees the model can be sharded at (``shardable``, see
    :class:`ContractInputs`): a claim over a layout that cannot run is no claim."""
    bitwise = profile["name"] == Profile.CORRECTNESS
    claims: list[AxisClaim] = []
    for axis in sorted(parallel):
        value = to_canonical(parallel[axis], f"parallel.{axis}")
        domain = profile.get(f"{axis}_domain")
        if axis in NEUTRAL_AXES:
            claims.append(AxisClaim(axis, "neutral", tolerance=0))
        elif domain:
            domain = to_canonical(list(domain), f"profile.{axis}_domain")
            if value not in domain:
                raise ContractValidationError(
                    f"parallel.{axis}={value!r} is outside profile.{axis}_domain={domain} of profile "
                    f"'{profile['name']}'; allowed values: {domain}"
                )
            if axis in shardable:
                domain = [d for d in domain if d in shardable[axis]]
            claims.append(AxisClaim(axis, "invariant", domain=domain, tolerance=0 if bitwise else None))
        else:
            # No invariance claimed (or none proven, e.g. pp): the layout is part of the policy.
            claims.append(AxisClaim(axis, "pinned", value=value, tolerance=0 if bitwise else None))
    if bitwise:
        claims.append(AxisClaim("batch", "invariant", domain={"min": 1, "max": max_batch}, tolerance=0))
    else:
        claims.append(AxisClaim("batch", "unclaimed", tolerance=None))
    return claims


def _cases(cfg: Mapping[str, Any], model: Mapping[str, Any]) -> list[CaseSpec]:
    limits = cfg.get("contract") or {}
    max_batch = limits.get("max_batch", DEFAULT_MAX_BATCH)
    max_seq_len = limits.get("max_seq_len", model.get("max_position_embeddings"))
    for key, val in (("contract.max_batch", max_batch), ("contract.max_seq_len", max_seq_len)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ContractValidationError(f"{key}={val!r} must be a positive integer")
    if isinstance(model.get("max_position_embeddings"), int) and max_seq_len > model["max_position_embeddings"]:
        raise ContractValidationError(
            f"contract.max_seq_len={max_seq_len} exceeds model.max_position_embeddings={model['max_position_embeddings']}"
        )
    return [CaseSpec(c, CASE_SIDES[c], max_batch, max_seq_len, 1 if c == "decode" else None) for c in sorted(CASES)]


def _invalidation(rules: Any) -> tuple[InvalidationRule, ...]:
    if rules is None:
        return DEFAULT_INVALIDATION
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, Mapping) or not {"state", "event"} <= set(r) or not set(r) <= {"state", "event", "action"}:
            raise ContractValidationError(
                f"contract.invalidation[{i}]={r!r}: expected {{state: ..., event: ..., action: flush}} "
                "(keys state, event, optional action)"
            )
        out.append(InvalidationRule(str(r["state"]), str(r["event"]), str(r.get("action", "flush"))))
    return tuple(out)


def _composition(impls: Iterable[OpImpl], profile: Mapping[str, Any], bitwise: bool) -> list[CompositionEntry]:
    entries: list[CompositionEntry] = []
    for impl in sorted(impls, key=lambda i: i.op):
        constants = impl.canonical()["constants"]
        # An impl that pins a constant the profile also pins must agree with it, else the profile's
        # claim (e.g. leaves=16) describes arithmetic the impl does not do.
        for key, val in constants.items():
            if key in profile and key != "name" and to_canonical(profile[key]) != val:
                raise ContractValidationError(
                    f"composition.{impl.op}.constants.{key}={val!r} ({impl.ref}) disagrees with "
                    f"profile.{key}={profile[key]!r}; register an implementation for this value or change the profile"
                )
        refs = {impl.impl_for(c) for c in impl.cases}
        if len(refs) > 1 and bitwise and not impl.equivalence_note.strip():
            per_case = {c: impl.impl_for(c) for c in sorted(impl.cases)}
            raise ContractValidationError(
                f"composition.{impl.op}.equivalence_note is empty, but its cases are served by different "
                f"implementations {per_case}; an asymmetric entry must say why the results are bitwise equal"
            )
        for case in sorted(impl.cases):
            entries.append(
                CompositionEntry(
                    op=impl.op,
                    case=case,
                    impl=impl.impl_for(case),
                    device_class=impl.device_class,
                    constants=constants,
                    equivalence_note=impl.equivalence_note if len(refs) > 1 else "",
                )
            )
    return entries


def _runtime(device_class: str) -> dict[str, Any]:
    """Library versions whose kernels are part of the arithmetic (a torch upgrade may change a CPU GEMM)."""
    import torch

    out: dict[str, Any] = {"torch": str(torch.__version__)}
    if device_class == "cuda":
        try:
            import triton

            out["triton"] = str(triton.__version__)
        except ImportError:
            out["triton"] = None
        out["cuda"] = str(torch.version.cuda)
    return out


def build_contract(inputs: ContractInputs, impls: Iterable[OpImpl] | None = None) -> Contract:
    """The contract of resolved :class:`ContractInputs` (from a config: ``megatron_iso.settings.contract_for``,
    which every tool and the trainer use, and which first loads every registered implementation).

    ``impls`` defaults to the registry's implementations for the inputs' device class and profile.
    """
    if not isinstance(inputs, ContractInputs):
        raise TypeError(
            f"build_contract takes ContractInputs, got {type(inputs).__name__}; for a config use "
            "megatron_iso.settings.contract_for"
        )
    model, parallel, device_class = inputs.model, inputs.parallel, inputs.device_class
    # The profile was checked against the model when the inputs were made (settings.profile.validate_profile).
    profile = dict(inputs.profile)
    bitwise = profile["name"] == Profile.CORRECTNESS

    if impls is None:
        impls = registry.registered(device_class=device_class, profile=profile["name"])
    impls = list(impls)
    wrong = [i.ref for i in impls if i.device_class != device_class or i.profile != profile["name"]]
    if wrong:
        raise ContractValidationError(
            f"implementations {wrong} do not match device_class={device_class!r}, profile={profile['name']!r}"
        )
    if not impls:
        raise ContractValidationError(
            f"no op implementations registered for device_class={device_class!r}, profile={profile['name']!r}; "
            "megatron_iso.settings.contract_for loads them (megatron_iso.contract.load_op_implementations)"
        )

    cases = _cases({"contract": inputs.contract}, model)
    max_batch = cases[0].max_batch
    axes = _axis_claims(profile, parallel, max_batch, inputs.shardable)
    invalidation = _invalidation(inputs.contract.get("invalidation"))
    parity: dict[str, Any] = (
        {"kind": "bitwise", "quantity": "logprob_full_vocab", "equal_cases": sorted(CASES), "tolerance": 0}
        if bitwise
        else {"kind": "unclaimed", "quantity": "logprob_full_vocab", "equal_cases": [], "tolerance": None}
    )
    composition = _composition(impls, profile, bitwise)

    semantic = Semantic(
        model={k: to_canonical(model[k]) for k in MODEL_IDENTITY_KEYS if k in model},
        architecture={
            k: to_canonical(v, f"model.{k}")
            for k, v in model.items()
            if k not in MODEL_IDENTITY_KEYS and k not in MODEL_SOURCE_KEYS
        },
        op_vocabulary=tuple(sorted({e.op for e in composition})),
        cases=tuple(cases),
    )
    policy = NumericalPolicy(
        device_class=device_class,
        profile=profile["name"],
        # Domains live in the claims; everything else the profile sets is a pinned constant.
        constants={
            k: to_canonical(v, f"profile.{k}") for k, v in profile.items() if k != "name" and not k.endswith("_domain")
        },
        composition=tuple(composition),
        claims=Claims(axes=tuple(axes), parity=parity, invalidation=invalidation),
        runtime=_runtime(device_class),
    )
    from megatron_iso import __version__

    deployment = Deployment(
        parallel={k: to_canonical(v) for k, v in sorted(parallel.items())},
        device_name=_device_name(device_class),
        software={"megatron_iso": __version__, "python": ".".join(map(str, sys.version_info[:3]))},
    )
    return Contract(semantic, policy, deployment)
