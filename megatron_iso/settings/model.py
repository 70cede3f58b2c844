"""The ``profile``, ``model`` and ``parallel`` groups, typed and checked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_iso.contract.build import ContractValidationError, check_profile_name, resolve_device_class
from megatron_iso.registry import Profile
from megatron_iso.settings.fields import SettingsError, _bool, _get, _int, _number
from megatron_iso.settings.shapes import check_model_shapes

HF_GDN_LAYOUTS = ("qkvz", "split")
PARAMS_DTYPES = ("bf16", "fp32")


# --- profile -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileSettings:
    """``profile`` resolved for one device class. ``raw``: the group as the contract pins it (form resolved)."""

    name: Profile
    device_class: str  # "cpu" or "cuda", never "auto"
    leaves: int  # row-parallel GEMMs' and the vocab LSE's leaves the layers use (1 outside correctness)
    expert_leaves: int  # routed experts' down projection (1 outside correctness)
    attention_kv_block: int  # keys reduced in blocks of this many positions (0 in the profile: 64)
    gdn_chunk: int
    gdn_form: str  # "scan" or "chunk", never "auto"
    gdn_dot_precision: str | None
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)

    @property
    def bitwise(self) -> bool:
        return self.name is Profile.CORRECTNESS


def resolve_gdn_form(profile: Mapping[str, Any], device_class: str) -> tuple[str, str | None]:
    """(gdn_form, gdn_dot_precision) of ``profile`` on ``device_class``: "auto" resolved by the GDN family."""
    from megatron_iso.ops.gdn import gdn_profile_fields

    try:
        return gdn_profile_fields(profile, device_class)
    except ValueError as e:
        raise ContractValidationError(str(e)) from None


def check_gdn_choice_runs_here(profile: ProfileSettings) -> None:
    """Refuse a GDN (form, dot precision) where its kernels do not run, rather than write a contract whose
    composition computes something else (docs/GDN.md "Output forms"). The contract's check: a model config may
    still carry such a choice (its op then refuses to run)."""
    from megatron_iso.ops.gdn import gdn_choice_runs_here

    form, precision, device_class = profile.gdn_form, profile.gdn_dot_precision, profile.device_class
    if not gdn_choice_runs_here(form, precision, device_class, profile.name.value):
        raise ContractValidationError(
            f"profile.gdn_form={form!r}, profile.gdn_dot_precision={precision!r} need device=cuda and profile "
            f"correctness (the Triton GDN kernels); on device_class={device_class!r} with profile {profile.name.value!r} "
            "only gdn_form='scan' (or 'auto') with gdn_dot_precision=null exists"
        )


def _leaves(profile: Mapping[str, Any], key: str, default: int) -> int:
    """``profile.<key>`` as an int; the power-of-two rule and the model's sizes are the contract's
    ``validate_profile`` (run by ``check_config``), whose error says which powers the model allows."""
    value = _get(profile, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"profile.{key}={value!r} is not allowed; allowed values: powers of two (1, 2, 4, 8, ...)")
    return value


def resolve_profile(profile: Mapping[str, Any], device: Any) -> ProfileSettings:
    """``profile`` and ``device`` resolved (order of checks: device, profile.name, the GDN choice)."""
    device_class = resolve_device_class(device)
    name = check_profile_name(profile.get("name"))
    form, precision = resolve_gdn_form(profile, device_class)
    chunk = _int(_get(profile, "gdn_chunk", 64), "profile.gdn_chunk", 1)
    # 0 (the performance profile's): the attention's default block of 64 keys.
    kv_block = _int(_get(profile, "attention_kv_block", 64), "profile.attention_kv_block", 0) or 64
    bitwise = name is Profile.CORRECTNESS
    raw = {**profile, "gdn_form": form} if "gdn_form" in profile else dict(profile)
    return ProfileSettings(
        name=name,
        device_class=device_class,
        leaves=_leaves(profile, "leaves", 8) if bitwise else 1,
        expert_leaves=_leaves(profile, "expert_leaves", 1) if bitwise else 1,
        attention_kv_block=kv_block,
        gdn_chunk=chunk,
        gdn_form=form,
        gdn_dot_precision=precision,
        raw=raw,
    )


# --- model -------------------------------------------------------------------------------------------------------


# A hybrid model's per-layer token mixers (model.full_attention_interval as a list; HF's layer_types).
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class GDNSettings:
    """A hybrid model's Gated DeltaNet layers (``full_attention_interval`` set). ``full_attention_interval``: every
    k-th layer is full attention (an int k), or each layer's type (a tuple of :data:`LAYER_TYPES`, any pattern)."""

    full_attention_interval: int | tuple[str, ...]
    conv_kernel_dim: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    hf_layout: str  # model.hf_gdn_layout: "qkvz" (Qwen3-Next) or "split" (Qwen3.5); naming only


@dataclass(frozen=True)
class MoESettings:
    """An MoE model's experts (``num_experts`` set)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int | None
    shared_expert_gate: bool
    norm_topk_prob: bool
    aux_loss_coeff: float


@dataclass(frozen=True)
class ModelSettings:
    """``model``, typed. ``raw``: the plain group (the contract's semantic identity reads every key)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    zero_centered_norm: bool
    qk_layernorm: bool
    attention_output_gate: bool
    init_std: float
    rope_theta: float
    rotary_fraction: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    params_dtype: str
    gdn: GDNSettings | None
    moe: MoESettings | None
    init_from: str | None = None  # checkpoint the weights start from (checkpoint.init_from); None: seeded random
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)


def _layer_pattern(interval: Any, num_layers: Any) -> int | tuple[str, ...]:
    """``model.full_attention_interval``: an int k >= 1, or a list of one of :data:`LAYER_TYPES` per layer."""
    if isinstance(interval, Sequence) and not isinstance(interval, str):
        types = tuple(str(t) for t in interval)
        if any(t not in LAYER_TYPES for t in types) or len(types) != int(num_layers):
            raise SettingsError(
                f"model.full_attention_interval={list(types)!r} is not allowed; allowed values: an integer >= 1 "
                f"(every k-th layer full attention) or a list of {int(num_layers)} (model.num_layers) of {list(LAYER_TYPES)}"
            )
        return types
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise SettingsError(
            f"model.full_attention_interval={interval!r} is not allowed; allowed values: an integer >= 1 or a list of "
            f"{int(num_layers)} (model.num_layers) of {list(LAYER_TYPES)}"
        )
    return int(interval)


def resolve_gdn(model: Mapping[str, Any]) -> GDNSettings | None:
    """The GDN fields of a hybrid model (one with ``full_attention_interval``); None otherwise."""
    interval = _get(model, "full_attention_interval")
    if interval is None:
        return None
    pattern = _layer_pattern(interval, model["num_layers"])  # num_layers: checked by check_model_shapes
    layout = str(_get(model, "hf_gdn_layout", "qkvz"))
    if layout not in HF_GDN_LAYOUTS:
        raise SettingsError(f"model.hf_gdn_layout={layout!r} is not allowed; allowed values: {list(HF_GDN_LAYOUTS)}")
    return GDNSettings(
        full_attention_interval=pattern,
        conv_kernel_dim=int(model["linear_conv_kernel_dim"]),
        key_head_dim=int(model["linear_key_head_dim"]),
        value_head_dim=int(model["linear_value_head_dim"]),
        num_key_heads=int(model["linear_num_key_heads"]),
        num_value_heads=int(model["linear_num_value_heads"]),
        hf_layout=layout,
    )


def resolve_moe(model: Mapping[str, Any]) -> MoESettings | None:
    experts = _get(model, "num_experts")
    if experts is None:
        return None
    shared = _get(model, "shared_expert_ffn_hidden_size")
    return MoESettings(
        num_experts=int(experts),
        topk=int(model["moe_topk"]),
        ffn_hidden_size=int(model["moe_ffn_hidden_size"]),
        shared_expert_ffn_hidden_size=None if shared is None else int(shared),
        shared_expert_gate=_bool(_get(model, "shared_expert_gate", False), "model.shared_expert_gate"),
        norm_topk_prob=_bool(_get(model, "norm_topk_prob", True), "model.norm_topk_prob"),
        aux_loss_coeff=float(_get(model, "moe_aux_loss_coeff", 0.0)),
    )


def check_init_from(value: Any) -> str | None:
    """``model.init_from``: null, or the path of a checkpoint directory (what it holds: ``checkpoint.init_from``)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise SettingsError(
            f"model.init_from={value!r} is not allowed; allowed values: null or the path of an HF model directory, "
            "a megatron_iso checkpoint or a run checkpoint"
        )
    return value


# The model's switches and their defaults (a key an option leaves out takes its default).
_MODEL_FLAGS = {"zero_centered_norm": False, "qk_layernorm": True, "attention_output_gate": False,
                "tie_word_embeddings": False}  # fmt: skip


def resolve_model(model: Mapping[str, Any]) -> ModelSettings:
    """``model`` typed, once every shape rule holds (:func:`~megatron_iso.settings.shapes.check_model_shapes`)."""
    dtype = str(_get(model, "params_dtype", "fp32"))
    if dtype not in PARAMS_DTYPES:
        raise SettingsError(f"model.params_dtype={dtype!r} is not allowed; allowed values: {sorted(PARAMS_DTYPES)}")
    check_model_shapes(model)
    gdn, moe = resolve_gdn(model), resolve_moe(model)
    flag = {k: _bool(_get(model, k, d), f"model.{k}") for k, d in _MODEL_FLAGS.items()}
    return ModelSettings(
        num_layers=int(model["num_layers"]),
        hidden_size=int(model["hidden_size"]),
        ffn_hidden_size=int(model["ffn_hidden_size"]),
        num_attention_heads=int(model["num_attention_heads"]),
        num_query_groups=int(model["num_query_groups"]),
        kv_channels=int(model["kv_channels"]),
        norm_epsilon=float(model["norm_epsilon"]),
        zero_centered_norm=flag["zero_centered_norm"],
        qk_layernorm=flag["qk_layernorm"],
        attention_output_gate=flag["attention_output_gate"],
        init_std=_number(_get(model, "init_std", 0.02), "model.init_std", 0.0, open_low=True),
        rope_theta=float(model["rope_theta"]),
        rotary_fraction=float(_get(model, "rotary_fraction", 1.0)),
        vocab_size=int(model["vocab_size"]),
        max_position_embeddings=int(model["max_position_embeddings"]),
        tie_word_embeddings=flag["tie_word_embeddings"],
        params_dtype=dtype,
        gdn=gdn,
        moe=moe,
        init_from=check_init_from(_get(model, "init_from")),
        raw=dict(model),
    )


# --- parallel, rl, rollout ---------------------------------------------------------------------------------------


# Model sizes a parallel degree must divide for Megatron to shard the model at all. TP splits the attention heads and
# query groups, the GDN key and value heads, the dense and shared-expert FFN (column- then row-parallel) and the vocab
# (embedding and LM head, never padded); EP splits the routed experts (never split by TP).
SHARDED_BY: dict[str, tuple[str, ...]] = {
    "tp": (
        "num_attention_heads",
        "num_query_groups",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "ffn_hidden_size",
        "shared_expert_ffn_hidden_size",
        "vocab_size",
    ),
    "ep": ("num_experts",),
}
# What a model without any of an axis's sizes is, for check_shardable's error.
_NOTHING_TO_SHARD = {"ep": "a dense model: it has no routed experts (model.num_experts is not set)"}


def _sharded_sizes(model: Mapping[str, Any], axis: str) -> dict[str, int]:
    """The sizes of ``model`` that ``parallel.<axis>`` splits (the positive integers among :data:`SHARDED_BY`)."""
    sizes = {k: model.get(k) for k in SHARDED_BY.get(axis, ())}
    return {k: v for k, v in sizes.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _shards_at(sizes: Mapping[str, int], degree: int) -> bool:
    """Whether Megatron can shard a model whose sizes split by an axis are ``sizes`` (:func:`_sharded_sizes`) at
    ``degree``: one dividing every size; with none of them (a dense model's EP) degree 1 only. The one rule behind
    the layout check (:func:`check_shardable`) and the contract's invariance domains (:func:`shard_degrees`), so a
    contract claims no layout the trainer refuses."""
    if not sizes:
        return degree == 1
    return all(size % degree == 0 for size in sizes.values())


def shard_degrees(model: Mapping[str, Any], axis: str, candidates: Sequence[int] | None = None) -> list[int]:
    """The degrees of ``parallel.<axis>`` among ``candidates`` (default: 1 up to the smallest sharded size) at which
    Megatron can shard ``model`` (:func:`_shards_at`): those dividing every size :data:`SHARDED_BY` names for the
    axis. An axis that splits none of the model's sizes (EP of a dense model) keeps degree 1 only, as
    :func:`check_shardable` refuses any other: the contract's invariance domain of that axis is ``[1]``."""
    sizes = _sharded_sizes(model, axis)
    if candidates is None:
        candidates = range(1, min(sizes.values(), default=1) + 1)
    return [d for d in candidates if _shards_at(sizes, d)]


def check_shardable(
    model: Mapping[str, Any],
    axis: str,
    degree: int,
    field_name: str | None = None,
    candidates: Sequence[int] | None = None,
) -> None:
    """Refuse a ``parallel.<axis>`` degree (a positive int) at which Megatron cannot shard ``model``
    (:func:`_shards_at`): the one sharding check of the trainer's layout (:func:`resolve_parallel`) and the
    rollout's (``rollout.parallel.tp``), whose rule also narrows the contract's invariance domains
    (:func:`shard_degrees`). The error names ``field_name`` (default ``parallel.<axis>``), the sizes the degree does
    not divide and the allowed degrees among ``candidates``. A model with none of the sizes the axis splits (a dense
    model's EP) takes degree 1 only."""
    sizes = _sharded_sizes(model, axis)
    if _shards_at(sizes, degree):
        return
    if not sizes:
        names = ", ".join(f"model.{k}" for k in SHARDED_BY.get(axis, ()))
        what = _NOTHING_TO_SHARD.get(axis, f"this model: it sets none of {names}")
        raise SettingsError(
            f"{field_name or f'parallel.{axis}'}={degree} does not apply to {what}; allowed values: [1]"
        )
    shown = ", ".join(f"model.{k}={v}" for k, v in sizes.items() if v % degree)
    raise SettingsError(
        f"{field_name or f'parallel.{axis}'}={degree} does not divide {shown}: Megatron cannot shard this model "
        f"that way; allowed values: {shard_degrees(model, axis, candidates)}"
    )


@dataclass
class ParallelSettings:
    """``parallel`` (conf/parallel/*.yaml). Also the group's structured-config schema."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    dp: int | None = None  # data parallel: null derives it from the world size (world / (tp * pp)); a value must agree
    cp: int = 1  # context parallelism: the trainer's packs split over CP ranks (parallel.context), in CP_DEGREES


CP_DEGREES = (1, 2, 4, 8)


def cp_degrees(model: Mapping[str, Any], candidates: Sequence[int] = CP_DEGREES) -> list[int]:
    """The ``parallel.cp`` degrees among ``candidates`` that ``model`` runs at: every one of :data:`CP_DEGREES`, for
    attention-only models and Gated DeltaNet hybrids alike (``models.gdn``: the GDN layers run the whole pack on
    every CP rank). The layout check and the contract's ``cp_domain`` both read it."""
    return [d for d in candidates if d in CP_DEGREES]


def check_cp(model: Mapping[str, Any] | None, parallel: ParallelSettings) -> None:
    """Refuse a ``parallel.cp`` outside :data:`CP_DEGREES`, or one with a pipeline (every model family runs every
    degree: :func:`cp_degrees`)."""
    cp = parallel.cp
    if cp not in CP_DEGREES:
        raise SettingsError(f"parallel.cp={cp} is not allowed; allowed values: {list(CP_DEGREES)}")
    if cp == 1:
        return
    if parallel.pp != 1:
        raise SettingsError(f"parallel.cp={cp} with parallel.pp={parallel.pp}: a pipelined trainer runs CP 1; "
                            "allowed values: [1]")  # fmt: skip


def resolve_parallel(parallel: Mapping[str, Any], model: Mapping[str, Any] | None = None) -> ParallelSettings:
    """``parallel`` checked: every degree a positive integer; with ``model``, TP and EP degrees that divide the
    sizes Megatron shards by them (:func:`check_shardable`) and a CP degree the model runs (:func:`check_cp`)."""
    out = ParallelSettings(
        tp=_int(_get(parallel, "tp", 1), "parallel.tp", 1),
        pp=_int(_get(parallel, "pp", 1), "parallel.pp", 1),
        ep=_int(_get(parallel, "ep", 1), "parallel.ep", 1),
        sp=_bool(_get(parallel, "sp", False), "parallel.sp"),
        dp=None if parallel.get("dp") is None else _int(parallel["dp"], "parallel.dp", 1),
        cp=_int(_get(parallel, "cp", 1), "parallel.cp", 1),
    )
    check_cp(model, out)
    for axis in SHARDED_BY if model is not None else ():
        check_shardable(model, axis, getattr(out, axis))
    return out
