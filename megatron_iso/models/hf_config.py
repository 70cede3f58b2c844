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


class UnsupportedHFConfig(ValueError):
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


def _rope_theta(hf: Mapping[str, Any], default: float) -> float:
    """rope_theta from transformers 5's ``rope_parameters`` or the older top-level ``rope_theta``;
    only plain RoPE (rope_type 'default', no scaling) is implemented."""
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
    extra = sorted(set(params) - {"rope_type", "rope_theta"})
    if extra:
        raise UnsupportedHFConfig(
            f"config.json rope_parameters fields {extra} are not supported; supported fields: ['rope_type', 'rope_theta']"
        )
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


def _qwen3_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    _reject_unknown(hf, _QWEN3_FIELDS)
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "use_sliding_window", (False,), False)
    # Dropout only acts in training, but our trainer must see the model the checkpoint claims.
    _require(hf, "attention_dropout", (0, 0.0), 0.0)
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["full_attention"] * layers
    bad = sorted({t for t in types if t != "full_attention"})
    if bad or len(types) != layers:
        raise UnsupportedHFConfig(
            f"config.json layer_types={types!r} is not supported; supported: "
            f"{layers} x 'full_attention' (num_hidden_layers={layers})"
        )
    heads = int(hf["num_attention_heads"])
    return {
        "name": name,
        "family": "qwen3",
        "num_layers": layers,
        "hidden_size": int(hf["hidden_size"]),
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "kv_channels": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf["max_position_embeddings"]),
        "rope_theta": _rope_theta(hf, default=10000.0),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "qk_layernorm": True,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "params_dtype": _params_dtype(hf),
    }


def _qwen3_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    unsupported = {k: model.get(k) for k in ("attention_output_gate", "zero_centered_norm") if model.get(k)}
    if unsupported or not model.get("qk_layernorm", True) or float(model.get("rotary_fraction", 1.0)) != 1.0:
        raise UnsupportedHFConfig(f"model fields {unsupported or 'qk_layernorm/rotary_fraction'} have no Qwen3 HF form")
    layers = int(model["num_layers"])
    dtype = {v: k for k, v in HF_DTYPES.items()}[str(model.get("params_dtype", "fp32"))]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": int(model["vocab_size"]),
        "hidden_size": int(model["hidden_size"]),
        "intermediate_size": int(model["ffn_hidden_size"]),
        "num_hidden_layers": layers,
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
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
        "dtype": dtype,
    }


register_family(HFFamily("qwen3", "qwen3", _qwen3_to_model, _qwen3_to_hf))

# Recognised, being built elsewhere: replace these entries (register_family) when the family lands.
for _type, _family, _pending in (
    ("qwen3_moe", "qwen3_moe", "the MoE family (models/ MoE specs + HF expert weight mapping) has not landed"),
    ("qwen3_next", "qwen3_next", "the hybrid Gated DeltaNet family has not landed"),
    ("qwen3_5_text", "qwen3_next", "the hybrid Gated DeltaNet family (Qwen3.5 text) has not landed"),
    ("qwen3_5", "qwen3_next", "Qwen3.5 is multimodal; its text part needs the hybrid GDN family, which has not landed"),
    ("qwen3_5_moe_text", "qwen3_next", "the hybrid GDN + MoE family (Qwen3.5-MoE text) has not landed"),
    ("qwen3_5_moe", "qwen3_next", "Qwen3.5-MoE is multimodal; its text part needs hybrid GDN + MoE, not landed"),
):
    register_family(HFFamily(_type, _family, pending=_pending))
