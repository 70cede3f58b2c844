"""HF ``config.json`` <-> megatron_iso's model config (the keys of ``conf/model/*.yaml``).

One registry, :data:`FAMILIES`, maps an HF ``model_type`` to the functions that translate its
config both ways. A family another engineer is still building is registered without translators,
so its checkpoints fail with a message naming the family instead of a confusing KeyError.

Translators are strict: a field that would change the computation and that megatron_iso does not
implement (rope scaling, attention bias, sliding windows, quantization, ...) is an error naming the
field and the values that are supported. A field nobody listed is an error too, since we cannot
know whether it changes the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_iso.errors import UserError

HF_CONFIG_FILE = "config.json"

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


@dataclass(frozen=True)
class HFFamily:
    """How one HF ``model_type`` maps to a megatron_iso model family.

    ``to_model(hf, name) -> conf/model dict`` and ``to_hf(model) -> config.json dict`` are None for a
    family that is recognised but not implemented yet; ``pending`` then says what is missing.
    """

    model_type: str
    family: str
    to_model: Callable[[Mapping[str, Any], str], dict[str, Any]] | None = None
    to_hf: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    pending: str = ""


FAMILIES: dict[str, HFFamily] = {}


def register_family(entry: HFFamily) -> HFFamily:
    """Add (or replace) the translators for ``entry.model_type``."""
    FAMILIES[entry.model_type] = entry
    return entry


def _family_for_type(model_type: Any) -> HFFamily:
    if model_type not in FAMILIES:
        raise UnsupportedHFConfig(f"config.json model_type={model_type!r} is not supported; known: {sorted(FAMILIES)}")
    entry = FAMILIES[model_type]
    if entry.to_model is None:
        raise UnsupportedHFConfig(
            f"config.json model_type={model_type!r} (family {entry.family!r}) is not supported yet: {entry.pending}; "
            f"supported now: {supported_model_types()}"
        )
    return entry


def supported_model_types() -> list[str]:
    return sorted(t for t, f in FAMILIES.items() if f.to_model is not None)


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / HF_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} has no {HF_CONFIG_FILE}: not an HF model directory")
    return json.loads(path.read_text(encoding="utf-8"))


def model_config_from_hf(hf: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """The ``conf/model`` dict (``name``, ``family``, shapes, ...) described by an HF config dict."""
    entry = _family_for_type(hf.get("model_type"))
    assert entry.to_model is not None
    return entry.to_model(hf, name or f"hf_{entry.model_type}")


def hf_config_from_model(model: Mapping[str, Any]) -> dict[str, Any]:
    """An HF ``config.json`` dict for a megatron_iso model config (used when a checkpoint has none)."""
    family = model.get("family")
    for entry in FAMILIES.values():
        if entry.family == family and entry.to_hf is not None:
            return entry.to_hf(model)
    raise UnsupportedHFConfig(
        f"model.family={family!r} has no HF config translator; supported: "
        f"{sorted({f.family for f in FAMILIES.values() if f.to_hf is not None})}"
    )


# ---------------------------------------------------------------- shared checks


def _require(hf: Mapping[str, Any], field: str, allowed: tuple[Any, ...], default: Any) -> None:
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


def _rope_parameters(hf: Mapping[str, Any], extra: tuple[str, ...] = ()) -> dict[str, Any]:
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
    params = _rope_parameters(hf, extra)
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def _reject_unknown(hf: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(hf) - known - GENERIC_HF_FIELDS)
    if unknown:
        raise UnsupportedHFConfig(
            f"config.json fields {unknown} are not supported for model_type={hf.get('model_type')!r} "
            f"(megatron_iso cannot tell whether they change the model); supported fields: {sorted(known)}"
        )


# ---------------------------------------------------------------- qwen3 (dense)

_QWEN3_FIELDS = frozenset(
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
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "use_sliding_window", (False,), False)
    # Dropout only acts in training, but our trainer must see the model the checkpoint claims.
    _require(hf, "attention_dropout", (0, 0.0), 0.0)


def _decoder_fields(hf: Mapping[str, Any], name: str, family: str, rope_extra: tuple[str, ...] = ()) -> dict[str, Any]:
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


def _hf_decoder_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`_decoder_fields` (config.json keys shared by the Qwen3 families)."""
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


def _refuse_model_fields(model: Mapping[str, Any], model_type: str, expected: Mapping[str, Any]) -> None:
    """A model config whose computation the HF ``model_type`` cannot express is an error naming the field."""
    for key, value in expected.items():
        got = model.get(key, value)  # an absent key means the default, which is what the family needs
        if got != value:
            raise UnsupportedHFConfig(f"model.{key}={got!r} has no {model_type} HF form; {model_type} needs {value!r}")


def _check_full_attention_layers(hf: Mapping[str, Any]) -> None:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["full_attention"] * layers
    bad = sorted({t for t in types if t != "full_attention"})
    if bad or len(types) != layers:
        raise UnsupportedHFConfig(
            f"config.json layer_types={types!r} is not supported; supported: "
            f"{layers} x 'full_attention' (num_hidden_layers={layers})"
        )


def _qwen3_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    _reject_unknown(hf, _QWEN3_FIELDS)
    _check_full_attention_layers(hf)
    return _decoder_fields(hf, name, "qwen3")


_DENSE_ONLY = {
    "attention_output_gate": False,
    "zero_centered_norm": False,
    "qk_layernorm": True,
    "rotary_fraction": 1.0,
    "full_attention_interval": None,
}


def _qwen3_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    _refuse_model_fields(model, "qwen3", {**_DENSE_ONLY, "num_experts": None})
    layers = int(model["num_layers"])
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_hf_decoder_fields(model),
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
    }


register_family(HFFamily("qwen3", "qwen3", _qwen3_to_model, _qwen3_to_hf))

# ---------------------------------------------------------------- MoE MLP (Qwen3-MoE, Qwen3-Next)

_MOE_FIELDS = frozenset(
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


# transformers' config-class defaults, which apply to fields a config.json leaves out.
_QWEN3_MOE_DEFAULTS = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
}
_QWEN3_NEXT_DEFAULTS = {
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
}


def _num_experts(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> int:
    return int(hf.get("num_experts", hf.get("num_local_experts", defaults["num_experts"])))


def _moe_fields(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """conf/model MoE keys (read by ``models.transformer_config.moe_fields``); every decoder layer is MoE, so
    sparse steps and dense-only layers other than the defaults are refused."""
    experts = _num_experts(hf, defaults)  # before the defaults: num_local_experts may carry it
    hf = {**defaults, **hf}
    _require(hf, "decoder_sparse_step", (1,), 1)
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


def _gated_shared_moe_fields(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_moe_fields` plus the sigmoid-gated shared expert of Qwen3-Next / Qwen3.5-MoE."""
    shared = int(hf.get("shared_expert_intermediate_size", 512))
    if shared < 1:
        raise UnsupportedHFConfig(
            f"config.json shared_expert_intermediate_size={shared} is not supported with experts; it must be >= 1"
        )
    return _moe_fields(hf, defaults) | {"shared_expert_ffn_hidden_size": shared, "shared_expert_gate": True}


def _hf_moe_fields(model: Mapping[str, Any]) -> dict[str, Any]:
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


# ---------------------------------------------------------------- qwen3_moe


def _qwen3_moe_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    _reject_unknown(hf, _QWEN3_FIELDS | _MOE_FIELDS)
    _check_full_attention_layers(hf)
    return {
        **_decoder_fields(hf, name, "qwen3_moe"),
        **_moe_fields(hf, _QWEN3_MOE_DEFAULTS),
        "shared_expert_ffn_hidden_size": None,
        "shared_expert_gate": False,
    }


def _qwen3_moe_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    _refuse_model_fields(model, "qwen3_moe", {**_DENSE_ONLY, "shared_expert_ffn_hidden_size": None})
    if model.get("num_experts") is None:
        raise UnsupportedHFConfig("model.num_experts=None has no qwen3_moe HF form; qwen3_moe needs experts")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_hf_decoder_fields(model),
        **_hf_moe_fields(model),
        "use_sliding_window": False,
        "sliding_window": None,
    }


register_family(HFFamily("qwen3_moe", "qwen3_moe", _qwen3_moe_to_model, _qwen3_moe_to_hf))

# ---------------------------------------------------------------- qwen3_next (hybrid GDN)

_QWEN3_NEXT_FIELDS = (
    _QWEN3_FIELDS
    | _MOE_FIELDS
    | {
        "full_attention_interval",
        "partial_rotary_factor",
        "shared_expert_intermediate_size",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    }
)
# conf/model key: how the HF checkpoint stores GDN's input projections (models/weights.py: HF_GDN_LAYOUTS).
HF_GDN_LAYOUT_KEY = "hf_gdn_layout"
_GDN_KEYS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


_HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")


def _full_attention_interval(hf: Mapping[str, Any]) -> int | list[str]:
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
    if len(types) != layers or any(t not in _HYBRID_LAYER_TYPES for t in types):
        raise UnsupportedHFConfig(
            f"config.json layer_types={types!r} is not supported; supported: a list of num_hidden_layers={layers} "
            f"entries, each one of {list(_HYBRID_LAYER_TYPES)}"
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


def _qwen3_next_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    _reject_unknown(hf, _QWEN3_NEXT_FIELDS)
    rope = _rope_parameters(hf, ("partial_rotary_factor",))
    # Qwen3NextConfig defaults the factor to 0.25 when config.json does not give one.
    fraction = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    if not 0.0 < fraction <= 1.0:
        raise UnsupportedHFConfig(f"config.json partial_rotary_factor={fraction} is not supported; allowed: (0, 1]")
    gdn = {key: int(hf.get(key, default)) for key, default in zip(_GDN_KEYS, (4, 128, 128, 16, 32), strict=True)}
    if gdn["linear_num_value_heads"] % gdn["linear_num_key_heads"]:
        raise UnsupportedHFConfig(
            f"config.json linear_num_value_heads={gdn['linear_num_value_heads']} is not supported: it must be a "
            f"multiple of linear_num_key_heads={gdn['linear_num_key_heads']}"
        )
    out = {
        **_decoder_fields(hf, name, "qwen3_next", rope_extra=("partial_rotary_factor",)),
        "rotary_fraction": fraction,
        # Qwen3-Next's RMSNorms scale by (1 + w) and its attention has a sigmoid output gate.
        "zero_centered_norm": True,
        "attention_output_gate": True,
        "full_attention_interval": _full_attention_interval(hf),
        **gdn,
    }
    if _num_experts(hf, _QWEN3_NEXT_DEFAULTS) == 0:  # HF then builds a dense MLP (intermediate_size) in every layer
        return out
    return out | _gated_shared_moe_fields(hf, _QWEN3_NEXT_DEFAULTS)


def _qwen3_next_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    required = {"attention_output_gate": True, "zero_centered_norm": True, "qk_layernorm": True}
    required[HF_GDN_LAYOUT_KEY] = "qkvz"
    if model.get("num_experts") is not None:
        required["shared_expert_gate"] = True
        if model.get("shared_expert_ffn_hidden_size") is None:
            raise UnsupportedHFConfig("model.shared_expert_ffn_hidden_size=None has no qwen3_next HF form (needs one)")
    _refuse_model_fields(model, "qwen3_next", required)
    if model.get("full_attention_interval") is None:
        raise UnsupportedHFConfig("model.full_attention_interval=None has no qwen3_next HF form (needs GDN layers)")
    hf = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **_hf_decoder_fields(model)}
    hf["rope_parameters"]["partial_rotary_factor"] = float(model.get("rotary_fraction", 1.0))
    hf["layer_types"] = hybrid_layer_types(model)
    hf |= {key: int(model[key]) for key in _GDN_KEYS}
    if model.get("num_experts") is None:
        return hf | {"num_experts": 0}
    return hf | _hf_moe_fields(model) | {"shared_expert_intermediate_size": int(model["shared_expert_ffn_hidden_size"])}


register_family(HFFamily("qwen3_next", "qwen3_next", _qwen3_next_to_model, _qwen3_next_to_hf))

# ---------------------------------------------------------------- qwen3_5 (text; dense and MoE)

# Qwen3.5 text = Qwen3-Next's blocks (GDN x (k-1) + gated attention, zero-centred norms) with GDN's
# projections stored flat (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a: ``HF_GDN_LAYOUT_KEY``) and
# mRoPE. Text tokens get the same position on mRoPE's three axes, so its sections rotate exactly as
# plain RoPE: ``mrope_section`` / ``mrope_interleaved`` are accepted, for text input only.
_QWEN3_5_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
_QWEN3_5_FIELDS = (_QWEN3_NEXT_FIELDS - _MOE_FIELDS - {"shared_expert_intermediate_size", "sliding_window"}) | {
    "attn_output_gate",  # the attention's sigmoid output gate; only true is implemented
    "mamba_ssm_dtype",  # dtype of GDN's recurrent state; ours is fp32
    "mtp_num_hidden_layers",  # multi-token-prediction head: not part of the causal LM's logits (mtp.* dropped)
    "mtp_use_dedicated_embeddings",
}
_QWEN3_5_MOE_FIELDS = (_QWEN3_5_FIELDS - {"intermediate_size"}) | {
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
    "output_router_logits",
}
# Qwen3_5MoeTextConfig's defaults; its router always renormalises the top-k (no norm_topk_prob field).
_QWEN3_5_MOE_DEFAULTS = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
}
# Multimodal wrappers: config.json nests the text model's config under text_config.
_QWEN3_5_VL_FIELDS = frozenset(
    {
        "text_config",
        "vision_config",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "tie_word_embeddings",
    }
)
QWEN3_5_VL_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def _qwen3_5_common(hf: Mapping[str, Any], name: str, family: str, known: frozenset[str]) -> dict[str, Any]:
    _reject_unknown(hf, known)
    _require(hf, "attn_output_gate", (True,), True)
    _require(hf, "mamba_ssm_dtype", ("float32",), "float32")
    rope = _rope_parameters(hf, _QWEN3_5_ROPE)
    fraction = float(rope.get("partial_rotary_factor", 0.25))
    if not 0.0 < fraction <= 1.0:
        raise UnsupportedHFConfig(f"config.json partial_rotary_factor={fraction} is not supported; allowed: (0, 1]")
    gdn = {key: int(hf.get(key, default)) for key, default in zip(_GDN_KEYS, (4, 128, 128, 16, 32), strict=True)}
    if gdn["linear_num_value_heads"] % gdn["linear_num_key_heads"]:
        raise UnsupportedHFConfig(
            f"config.json linear_num_value_heads={gdn['linear_num_value_heads']} is not supported: it must be a "
            f"multiple of linear_num_key_heads={gdn['linear_num_key_heads']}"
        )
    return {
        **_decoder_fields(hf, name, family, rope_extra=_QWEN3_5_ROPE),
        "rotary_fraction": fraction,
        "zero_centered_norm": True,
        "attention_output_gate": True,
        "full_attention_interval": _full_attention_interval(hf),
        **gdn,
        HF_GDN_LAYOUT_KEY: "split",
    }


def _qwen3_5_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    return _qwen3_5_common(hf, name, "qwen3_5", _QWEN3_5_FIELDS)


def _qwen3_5_moe_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    # No intermediate_size: every layer is MoE. Megatron still wants ffn_hidden_size; it is unused.
    hf_ = {**hf, "intermediate_size": hf.get("moe_intermediate_size", _QWEN3_5_MOE_DEFAULTS["moe_intermediate_size"])}
    out = _qwen3_5_common(hf_, name, "qwen3_5_moe", _QWEN3_5_MOE_FIELDS | {"intermediate_size"})
    experts = _num_experts(hf, _QWEN3_5_MOE_DEFAULTS)
    if experts < 1:
        raise UnsupportedHFConfig(f"config.json num_experts={experts} is not supported; qwen3_5_moe needs >= 1")
    return out | _gated_shared_moe_fields(hf, _QWEN3_5_MOE_DEFAULTS)


def _qwen3_5_vl_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A multimodal Qwen3.5 config.json: its ``text_config`` is the model megatron_iso runs (text only;
    the vision tower is not loaded)."""
    _reject_unknown(hf, _QWEN3_5_VL_FIELDS)
    return model_config_from_hf(vl_text_config(hf), name)


def vl_text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config.json dict of a multimodal Qwen3.5 config (``text_config`` with its
    ``model_type``; a top-level ``tie_word_embeddings`` is what the wrapper ties by)."""
    outer = hf.get("model_type")
    text = dict(hf.get("text_config") or {})
    want = QWEN3_5_VL_TEXT_TYPES[outer]
    if text.get("model_type", want) != want:
        raise UnsupportedHFConfig(
            f"config.json text_config.model_type={text.get('model_type')!r} is not supported in a {outer!r} "
            f"config; supported values: [{want!r}]"
        )
    if "tie_word_embeddings" in hf:
        if "tie_word_embeddings" in text and bool(text["tie_word_embeddings"]) != bool(hf["tie_word_embeddings"]):
            raise UnsupportedHFConfig(
                f"config.json tie_word_embeddings={hf['tie_word_embeddings']!r} differs from "
                f"text_config.tie_word_embeddings={text['tie_word_embeddings']!r}"
            )
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text | {"model_type": want}


def is_multimodal(hf: Mapping[str, Any]) -> bool:
    """Whether ``hf`` is a multimodal wrapper whose text part megatron_iso extracts."""
    return hf.get("model_type") in QWEN3_5_VL_TEXT_TYPES


_TEXT_ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


def text_model_hf_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json of the model megatron_iso runs: ``hf`` itself, or a multimodal wrapper's text
    model (what ``export`` writes for a checkpoint imported from one)."""
    if not is_multimodal(hf):
        return dict(hf)
    text = vl_text_config(hf)
    return {"architectures": [_TEXT_ARCHITECTURES[text["model_type"]]], **text}


def _qwen3_5_to_hf_common(model: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    required = {
        "attention_output_gate": True,
        "zero_centered_norm": True,
        "qk_layernorm": True,
        HF_GDN_LAYOUT_KEY: "split",
    }
    _refuse_model_fields(model, model_type, required)
    if model.get("full_attention_interval") is None:
        raise UnsupportedHFConfig(f"model.full_attention_interval=None has no {model_type} HF form (needs GDN layers)")
    hf = {"model_type": model_type, **_hf_decoder_fields(model)}
    hf["rope_parameters"]["partial_rotary_factor"] = float(model.get("rotary_fraction", 1.0))
    hf["layer_types"] = hybrid_layer_types(model)
    return hf | {key: int(model[key]) for key in _GDN_KEYS}


def _qwen3_5_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    if model.get("num_experts") is not None:
        raise UnsupportedHFConfig("model.num_experts has no qwen3_5_text HF form (dense); use family qwen3_5_moe")
    return {"architectures": ["Qwen3_5ForCausalLM"], **_qwen3_5_to_hf_common(model, "qwen3_5_text")}


def _qwen3_5_moe_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    if model.get("num_experts") is None or model.get("shared_expert_ffn_hidden_size") is None:
        raise UnsupportedHFConfig(
            "model.num_experts / model.shared_expert_ffn_hidden_size=None have no qwen3_5_moe_text HF form (needs both)"
        )
    _refuse_model_fields(model, "qwen3_5_moe_text", {"shared_expert_gate": True, "norm_topk_prob": True})
    hf = _qwen3_5_to_hf_common(model, "qwen3_5_moe_text")
    del hf["intermediate_size"]
    moe = _hf_moe_fields(model)
    for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
        del moe[key]
    shared = {"shared_expert_intermediate_size": int(model["shared_expert_ffn_hidden_size"])}
    return {"architectures": ["Qwen3_5MoeForCausalLM"], **hf, **moe, **shared}


register_family(HFFamily("qwen3_5_text", "qwen3_5", _qwen3_5_to_model, _qwen3_5_to_hf))
register_family(HFFamily("qwen3_5_moe_text", "qwen3_5_moe", _qwen3_5_moe_to_model, _qwen3_5_moe_to_hf))
# The multimodal wrappers import their text part; export writes the text model (no to_hf of their own).
register_family(HFFamily("qwen3_5", "qwen3_5", _qwen3_5_vl_to_model))
register_family(HFFamily("qwen3_5_moe", "qwen3_5_moe", _qwen3_5_vl_to_model))
