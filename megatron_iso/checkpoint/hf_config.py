"""HF ``config.json`` <-> megatron_iso's model config (the keys of ``conf/model/*.yaml``).

One registry, :data:`FAMILIES`, maps an HF ``model_type`` to the functions that translate its
config both ways. A family another engineer is still building is registered without translators,
so its checkpoints fail with a message naming the family instead of a confusing KeyError.

Translators are strict: a field that would change the computation and that megatron_iso does not
implement (rope scaling, attention bias, sliding windows, quantization, ...) is an error naming the
field and the values that are supported. A field nobody listed is an error too, since we cannot
know whether it changes the model. The pieces the families share (decoder, MoE MLP, GDN hybrid) live in
:mod:`megatron_iso.checkpoint.hf_fields`; this module holds the registry, each family's own table and
the multimodal wrappers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_iso.checkpoint.hf_fields import (
    DECODER_FIELDS,
    GDN_KEYS,
    HF_GDN_LAYOUT_KEY,
    MOE_FIELDS,
    UnsupportedHFConfig,
    check_full_attention_layers,
    decoder_from_hf,
    decoder_to_hf,
    full_attention_interval,
    gated_shared_moe_from_hf,
    gdn_from_hf,
    hybrid_layer_types,
    moe_from_hf,
    moe_to_hf,
    num_experts,
    refuse_model_fields,
    reject_unknown,
    require,
    rope_parameters,
)

HF_CONFIG_FILE = "config.json"


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


# ---------------------------------------------------------------- qwen3 (dense)


def _qwen3_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    reject_unknown(hf, DECODER_FIELDS)
    check_full_attention_layers(hf)
    return decoder_from_hf(hf, name, "qwen3")


_DENSE_ONLY = {
    "attention_output_gate": False,
    "zero_centered_norm": False,
    "qk_layernorm": True,
    "rotary_fraction": 1.0,
    "full_attention_interval": None,
}


def _qwen3_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    refuse_model_fields(model, "qwen3", {**_DENSE_ONLY, "num_experts": None})
    layers = int(model["num_layers"])
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **decoder_to_hf(model),
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
    }


register_family(HFFamily("qwen3", "qwen3", _qwen3_to_model, _qwen3_to_hf))

# ---------------------------------------------------------------- qwen3_moe

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


def _qwen3_moe_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    reject_unknown(hf, DECODER_FIELDS | MOE_FIELDS)
    check_full_attention_layers(hf)
    return {
        **decoder_from_hf(hf, name, "qwen3_moe"),
        **moe_from_hf(hf, _QWEN3_MOE_DEFAULTS),
        "shared_expert_ffn_hidden_size": None,
        "shared_expert_gate": False,
    }


def _qwen3_moe_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    refuse_model_fields(model, "qwen3_moe", {**_DENSE_ONLY, "shared_expert_ffn_hidden_size": None})
    if model.get("num_experts") is None:
        raise UnsupportedHFConfig("model.num_experts=None has no qwen3_moe HF form; qwen3_moe needs experts")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **decoder_to_hf(model),
        **moe_to_hf(model),
        "use_sliding_window": False,
        "sliding_window": None,
    }


register_family(HFFamily("qwen3_moe", "qwen3_moe", _qwen3_moe_to_model, _qwen3_moe_to_hf))

# ---------------------------------------------------------------- qwen3_next (hybrid GDN)

_QWEN3_NEXT_FIELDS = (
    DECODER_FIELDS
    | MOE_FIELDS
    | {
        "full_attention_interval",
        "partial_rotary_factor",
        "shared_expert_intermediate_size",
        *GDN_KEYS,
    }
)


def _qwen3_next_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    reject_unknown(hf, _QWEN3_NEXT_FIELDS)
    rope = rope_parameters(hf, ("partial_rotary_factor",))
    # Qwen3NextConfig defaults the factor to 0.25 when config.json does not give one.
    fraction = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    if not 0.0 < fraction <= 1.0:
        raise UnsupportedHFConfig(f"config.json partial_rotary_factor={fraction} is not supported; allowed: (0, 1]")
    gdn = gdn_from_hf(hf)
    out = {
        **decoder_from_hf(hf, name, "qwen3_next", rope_extra=("partial_rotary_factor",)),
        "rotary_fraction": fraction,
        # Qwen3-Next's RMSNorms scale by (1 + w) and its attention has a sigmoid output gate.
        "zero_centered_norm": True,
        "attention_output_gate": True,
        "full_attention_interval": full_attention_interval(hf),
        **gdn,
    }
    if num_experts(hf, _QWEN3_NEXT_DEFAULTS) == 0:  # HF then builds a dense MLP (intermediate_size) in every layer
        return out
    return out | gated_shared_moe_from_hf(hf, _QWEN3_NEXT_DEFAULTS)


def _qwen3_next_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    required = {"attention_output_gate": True, "zero_centered_norm": True, "qk_layernorm": True}
    required[HF_GDN_LAYOUT_KEY] = "qkvz"
    if model.get("num_experts") is not None:
        required["shared_expert_gate"] = True
        if model.get("shared_expert_ffn_hidden_size") is None:
            raise UnsupportedHFConfig("model.shared_expert_ffn_hidden_size=None has no qwen3_next HF form (needs one)")
    refuse_model_fields(model, "qwen3_next", required)
    if model.get("full_attention_interval") is None:
        raise UnsupportedHFConfig("model.full_attention_interval=None has no qwen3_next HF form (needs GDN layers)")
    hf = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **decoder_to_hf(model)}
    hf["rope_parameters"]["partial_rotary_factor"] = float(model.get("rotary_fraction", 1.0))
    hf["layer_types"] = hybrid_layer_types(model)
    hf |= {key: int(model[key]) for key in GDN_KEYS}
    if model.get("num_experts") is None:
        return hf | {"num_experts": 0}
    return hf | moe_to_hf(model) | {"shared_expert_intermediate_size": int(model["shared_expert_ffn_hidden_size"])}


register_family(HFFamily("qwen3_next", "qwen3_next", _qwen3_next_to_model, _qwen3_next_to_hf))

# ---------------------------------------------------------------- qwen3_5 (text; dense and MoE)

# Qwen3.5 text = Qwen3-Next's blocks (GDN x (k-1) + gated attention, zero-centred norms) with GDN's
# projections stored flat (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a: ``HF_GDN_LAYOUT_KEY``) and
# mRoPE. Text tokens get the same position on mRoPE's three axes, so its sections rotate exactly as
# plain RoPE: ``mrope_section`` / ``mrope_interleaved`` are accepted, for text input only.
_QWEN3_5_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
_QWEN3_5_FIELDS = (_QWEN3_NEXT_FIELDS - MOE_FIELDS - {"shared_expert_intermediate_size", "sliding_window"}) | {
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
    reject_unknown(hf, known)
    require(hf, "attn_output_gate", (True,), True)
    require(hf, "mamba_ssm_dtype", ("float32",), "float32")
    rope = rope_parameters(hf, _QWEN3_5_ROPE)
    fraction = float(rope.get("partial_rotary_factor", 0.25))
    if not 0.0 < fraction <= 1.0:
        raise UnsupportedHFConfig(f"config.json partial_rotary_factor={fraction} is not supported; allowed: (0, 1]")
    gdn = gdn_from_hf(hf)
    return {
        **decoder_from_hf(hf, name, family, rope_extra=_QWEN3_5_ROPE),
        "rotary_fraction": fraction,
        "zero_centered_norm": True,
        "attention_output_gate": True,
        "full_attention_interval": full_attention_interval(hf),
        **gdn,
        HF_GDN_LAYOUT_KEY: "split",
    }


def _qwen3_5_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    return _qwen3_5_common(hf, name, "qwen3_5", _QWEN3_5_FIELDS)


def _qwen3_5_moe_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    # No intermediate_size: every layer is MoE. Megatron still wants ffn_hidden_size; it is unused.
    hf_ = {**hf, "intermediate_size": hf.get("moe_intermediate_size", _QWEN3_5_MOE_DEFAULTS["moe_intermediate_size"])}
    out = _qwen3_5_common(hf_, name, "qwen3_5_moe", _QWEN3_5_MOE_FIELDS | {"intermediate_size"})
    experts = num_experts(hf, _QWEN3_5_MOE_DEFAULTS)
    if experts < 1:
        raise UnsupportedHFConfig(f"config.json num_experts={experts} is not supported; qwen3_5_moe needs >= 1")
    return out | gated_shared_moe_from_hf(hf, _QWEN3_5_MOE_DEFAULTS)


def _qwen3_5_vl_to_model(hf: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A multimodal Qwen3.5 config.json: its ``text_config`` is the model megatron_iso runs (text only;
    the vision tower is not loaded)."""
    reject_unknown(hf, _QWEN3_5_VL_FIELDS)
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
    refuse_model_fields(model, model_type, required)
    if model.get("full_attention_interval") is None:
        raise UnsupportedHFConfig(f"model.full_attention_interval=None has no {model_type} HF form (needs GDN layers)")
    hf = {"model_type": model_type, **decoder_to_hf(model)}
    hf["rope_parameters"]["partial_rotary_factor"] = float(model.get("rotary_fraction", 1.0))
    hf["layer_types"] = hybrid_layer_types(model)
    return hf | {key: int(model[key]) for key in GDN_KEYS}


def _qwen3_5_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    if model.get("num_experts") is not None:
        raise UnsupportedHFConfig("model.num_experts has no qwen3_5_text HF form (dense); use family qwen3_5_moe")
    return {"architectures": ["Qwen3_5ForCausalLM"], **_qwen3_5_to_hf_common(model, "qwen3_5_text")}


def _qwen3_5_moe_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    if model.get("num_experts") is None or model.get("shared_expert_ffn_hidden_size") is None:
        raise UnsupportedHFConfig(
            "model.num_experts / model.shared_expert_ffn_hidden_size=None have no qwen3_5_moe_text HF form (needs both)"
        )
    refuse_model_fields(model, "qwen3_5_moe_text", {"shared_expert_gate": True, "norm_topk_prob": True})
    hf = _qwen3_5_to_hf_common(model, "qwen3_5_moe_text")
    del hf["intermediate_size"]
    moe = moe_to_hf(model)
    for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
        del moe[key]
    shared = {"shared_expert_intermediate_size": int(model["shared_expert_ffn_hidden_size"])}
    return {"architectures": ["Qwen3_5MoeForCausalLM"], **hf, **moe, **shared}


register_family(HFFamily("qwen3_5_text", "qwen3_5", _qwen3_5_to_model, _qwen3_5_to_hf))
register_family(HFFamily("qwen3_5_moe_text", "qwen3_5_moe", _qwen3_5_moe_to_model, _qwen3_5_moe_to_hf))
# The multimodal wrappers import their text part; export writes the text model (no to_hf of their own).
register_family(HFFamily("qwen3_5", "qwen3_5", _qwen3_5_vl_to_model))
register_family(HFFamily("qwen3_5_moe", "qwen3_5_moe", _qwen3_5_vl_to_model))
