"""The ``model`` group, typed and checked (its shapes: ``settings.shapes``; how it shards: ``settings.parallel``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_iso.settings.fields import SettingsError, _bool, _get, _number
from megatron_iso.settings.shapes import check_model_shapes

HF_GDN_LAYOUTS = ("qkvz", "split")
PARAMS_DTYPES = ("bf16", "fp32")


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
