"""The ``config.json`` fields the Qwen families share, translated both ways.

Decoder shapes, RoPE, dtype, the MoE MLP and the GDN hybrid pattern mean the same in every family that
carries them, so :mod:`megatron_iso.checkpoint.hf_config` builds each family's translators from these
pieces. Each check is strict: a value megatron_iso does not implement is an error naming the field and
the supported values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_iso.errors import UserError

# HF dtype names <-> conf/model params_dtype names.
HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}

# Fields every PreTrainedConfig may carry that have no effect on a causal LM's forward.
GENERIC_HF_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
        "is_encoder_decoder",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "tokenizer_class",
    }
)


class UnsupportedHFConfig(UserError, ValueError):
    """The HF config describes a model megatron_iso cannot (yet) reproduce; the message names the field."""


# ---------------------------------------------------------------- shared checks


def require(hf: Mapping[str, Any], field: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = hf.get(field, default)
    if value not in allowed:
        raise UnsupportedHFConfig(f"config.json {field}={value!r} is not supported; supported values: {list(allowed)}")


def _params_dtype(hf: Mapping[str, Any]) -> str:
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if dtype not in HF_DTYPES:
        field = "dtype" if "dtype" in hf else "torch_dtype"
        raise UnsupportedHFConfig(
            f"config.json {field}={dtype!r} is not supported; supported values: {list(HF_DTYPES)}"
        )
    return HF_DTYPES[dtype]


def rope_parameters(hf: Mapping[str, Any], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` (or the older top-level ``rope_theta``/``rope_scaling``);
    only plain RoPE (rope_type 'default', no scaling) is implemented. ``extra`` are further fields a
    family may carry in ``rope_parameters`` (Qwen3-Next: ``partial_rotary_factor``)."""
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else scaling
        if kind != "default":
            raise UnsupportedHFConfig(
                f"config.json rope_scaling={scaling!r} is not supported; supported values: [null, {{rope_type: default}}]"
            )
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise UnsupportedHFConfig(
            f"config.json rope_parameters.rope_type={kind!r} is not supported; supported values: ['default']"
        )
    allowed = ["rope_type", "rope_theta", *extra]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise UnsupportedHFConfig(
            f"config.json rope_parameters fields {unknown} are not supported; supported fields: {allowed}"
        )
    return dict(params)


def _rope_theta(hf: Mapping[str, Any], default: float, extra: tuple[str, ...] = ()) -> float:
    params = rope_parameters(hf, extra)
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def reject_unknown(hf: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(hf) - known - GENERIC_HF_FIELDS)
    if unknown:
        raise UnsupportedHFConfig(
            f"config.json fields {unknown} are not supported for model_type={hf.get('model_type')!r} "
            f"(megatron_iso cannot tell whether they change the model); supported fields: {sorted(known)}"
        )


# ---------------------------------------------------------------- the decoder (every Qwen3 family)

# The fields of Qwen3's dense decoder; the other families add theirs to this set.
DECODER_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "attention_bias",
        "attention_dropout",
        "use_sliding_window",
        "sliding_window",  # only read when use_sliding_window is true
        "max_window_layers",  # idem
        "layer_types",
    }
)


def _check_attention(hf: Mapping[str, Any]) -> None:
    """Checks shared by the Qwen3 families' attention and MLP activation."""
    require(hf, "hidden_act", ("silu",), "silu")
    require(hf, "attention_bias", (False,), False)
    require(hf, "use_sliding_window", (False,), False)
    # Dropout only acts in training, but our trainer must see the model the checkpoint claims.
    require(hf, "attention_dropout", (0, 0.0), 0.0)


def decoder_from_hf(hf: Mapping[str, Any], name: str, family: str, rope_extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The conf/model keys every Qwen3 family shares (shapes, RoPE base, norms, dtype)."""
    _check_attention(hf)
    heads = int(hf["num_attention_heads"])
    return {
        "name": name,
        "family": family,
        "num_layers": int(hf["num_hidden_layers"]),
        "hidden_size": int(hf["hidden_size"]),
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "kv_channels": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf["max_position_embeddings"]),
        "rope_theta": _rope_theta(hf, default=10000.0, extra=rope_extra),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "qk_layernorm": True,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "params_dtype": _params_dtype(hf),
    }


def decoder_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`decoder_from_hf` (config.json keys shared by the Qwen3 families)."""
    return {
        "vocab_size": int(model["vocab_size"]),
        "hidden_size": int(model["hidden_size"]),
        "intermediate_size": int(model["ffn_hidden_size"]),
        "num_hidden_layers": int(model["num_layers"]),
        "num_attention_heads": int(model["num_attention_heads"]),
        "num_key_value_heads": int(model["num_query_groups"]),
        "head_dim": int(model["kv_channels"]),
        "hidden_act": "silu",
        "max_position_embeddings": int(model["max_position_embeddings"]),
        "rms_norm_eps": float(model["norm_epsilon"]),
        "tie_word_embeddings": bool(model.get("tie_word_embeddings", False)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model["rope_theta"])},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": {v: k for k, v in HF_DTYPES.items()}[str(model.get("params_dtype", "fp32"))],
    }


def refuse_model_fields(model: Mapping[str, Any], model_type: str, expected: Mapping[str, Any]) -> None:
    """A model config whose computation the HF ``model_type`` cannot express is an error naming the field."""
    for key, value in expected.items():
        got = model.get(key, value)  # an absent key means the default, which is what the family needs
        if got != value:
            raise UnsupportedHFConfig(f"model.{key}={got!r} has no {model_type} HF form; {model_type} needs {value!r}")


def check_full_attention_layers(hf: Mapping[str, Any]) -> None:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["full_attention"] * layers
    bad = sorted({t for t in types if t != "full_attention"})
    if bad or len(types) != layers:
        raise UnsupportedHFConfig(
            f"config.json layer_types={types!r} is not supported; supported: "
            f"{layers} x 'full_attention' (num_hidden_layers={layers})"
        )


# ---------------------------------------------------------------- MoE MLP (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE)

MOE_FIELDS = frozenset(
    {
        "num_experts",
        "num_local_experts",  # transformers 5 writes Qwen3-MoE's num_experts under this name
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "router_aux_loss_coef",
        "output_router_logits",  # only adds router logits to the outputs; logits unchanged
    }
)


def num_experts(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> int:
    return int(hf.get("num_experts", hf.get("num_local_experts", defaults["num_experts"])))


def moe_from_hf(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """conf/model MoE keys (read by ``models.transformer_config.moe_fields``); every decoder layer is MoE, so
    sparse steps and dense-only layers other than the defaults are refused."""
    experts = num_experts(hf, defaults)  # before the defaults: num_local_experts may carry it
    hf = {**defaults, **hf}
    require(hf, "decoder_sparse_step", (1,), 1)
    layers = hf.get("mlp_only_layers") or []
    if layers:
        raise UnsupportedHFConfig(
            f"config.json mlp_only_layers={layers!r} is not supported; supported values: [[]] (every layer MoE)"
        )
    topk = int(hf["num_experts_per_tok"])
    if not 1 <= topk <= experts:
        raise UnsupportedHFConfig(
            f"config.json num_experts_per_tok={topk} is not supported with num_experts={experts}; "
            f"supported values: 1..{experts}"
        )
    return {
        "num_experts": experts,
        "moe_topk": topk,
        "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf["norm_topk_prob"]),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def gated_shared_moe_from_hf(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`moe_from_hf` plus the sigmoid-gated shared expert of Qwen3-Next / Qwen3.5-MoE."""
    shared = int(hf.get("shared_expert_intermediate_size", 512))
    if shared < 1:
        raise UnsupportedHFConfig(
            f"config.json shared_expert_intermediate_size={shared} is not supported with experts; it must be >= 1"
        )
    return moe_from_hf(hf, defaults) | {"shared_expert_ffn_hidden_size": shared, "shared_expert_gate": True}


def moe_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": int(model["num_experts"]),
        "num_experts_per_tok": int(model["moe_topk"]),
        "moe_intermediate_size": int(model["moe_ffn_hidden_size"]),
        "norm_topk_prob": bool(model.get("norm_topk_prob", True)),
        "router_aux_loss_coef": float(model.get("moe_aux_loss_coeff", 0.0)),
        "output_router_logits": False,
    }


# ---------------------------------------------------------------- GDN hybrid (Qwen3-Next, Qwen3.5)

# conf/model key: how the HF checkpoint stores GDN's input projections (models/weights.py: HF_GDN_LAYOUTS).
HF_GDN_LAYOUT_KEY = "hf_gdn_layout"
GDN_KEYS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
# GDN_KEYS' values where a config.json leaves them out: Qwen3NextConfig's defaults, read for both hybrid families.
_GDN_DEFAULTS = (4, 128, 128, 16, 32)
HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")


def gdn_from_hf(hf: Mapping[str, Any]) -> dict[str, int]:
    """conf/model's GDN shape keys (the same names as in config.json); value heads group the key heads."""
    gdn = {key: int(hf.get(key, default)) for key, default in zip(GDN_KEYS, _GDN_DEFAULTS, strict=True)}
    if gdn["linear_num_value_heads"] % gdn["linear_num_key_heads"]:
        raise UnsupportedHFConfig(
            f"config.json linear_num_value_heads={gdn['linear_num_value_heads']} is not supported: it must be a "
            f"multiple of linear_num_key_heads={gdn['linear_num_key_heads']}"
        )
    return gdn


def full_attention_interval(hf: Mapping[str, Any]) -> int | list[str]:
    """The hybrid pattern as megatron_iso's ``full_attention_interval``: an int k when every k-th layer is full
    attention (Megatron's int ``linear_attention_freq``), else HF's ``layer_types`` list itself (any pattern of
    'linear_attention' / 'full_attention', as transformers accepts). Without ``layer_types``:
    ``full_attention_interval`` (default 4)."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        k = int(hf.get("full_attention_interval", 4))
        if k < 1:
            raise UnsupportedHFConfig(f"config.json full_attention_interval={k} is not supported; it must be >= 1")
        return k
    types = list(types)
    if len(types) != layers or any(t not in HYBRID_LAYER_TYPES for t in types):
        raise UnsupportedHFConfig(
            f"config.json layer_types={types!r} is not supported; supported: a list of num_hidden_layers={layers} "
            f"entries, each one of {list(HYBRID_LAYER_TYPES)}"
        )
    k = types.index("full_attention") + 1 if "full_attention" in types else layers + 1
    regular = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(layers)]
    return k if types == regular else types


def hybrid_layer_types(model: Mapping[str, Any]) -> list[str]:
    """HF's ``layer_types`` of a hybrid model config (``full_attention_interval``: an int k or the list itself)."""
    pattern, layers = model["full_attention_interval"], int(model["num_layers"])
    if isinstance(pattern, int):
        return ["full_attention" if (i + 1) % pattern == 0 else "linear_attention" for i in range(layers)]
    return [str(t) for t in pattern]
