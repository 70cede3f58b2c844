"""HF config.json -> conf/model: the mapping, and errors that name the unsupported field."""

from __future__ import annotations

import copy

import pytest

from megatron_iso.config import load_config
from megatron_iso.models.hf_config import (
    UnsupportedHFConfig,
    hf_config_from_model,
    model_config_from_hf,
    supported_model_types,
)

# Qwen/Qwen3-0.6B's config.json (transformers 4 era: top-level rope_theta, rope_scaling, torch_dtype).
QWEN3_0P6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_0p6b_maps_to_the_shipped_model_config():
    from omegaconf import OmegaConf

    ours = model_config_from_hf(QWEN3_0P6B, name="qwen3_0p6b")
    shipped = OmegaConf.to_container(load_config(["model=qwen3_0p6b"]).model)
    assert ours == shipped


def test_transformers5_rope_parameters_and_roundtrip():
    from transformers import Qwen3Config

    model = model_config_from_hf(QWEN3_0P6B, name="x")
    hf = hf_config_from_model(model)
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 1_000_000.0}
    assert model_config_from_hf(hf, name="x") == model
    # transformers accepts what we write and reads the same shapes back.
    cfg = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rope_parameters["rope_theta"]) == (128, 8, 1_000_000.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
        ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}),
        ("attention_bias", True),
        ("use_sliding_window", True),
        ("layer_types", ["sliding_attention"] * 28),
        ("hidden_act", "gelu"),
        ("torch_dtype", "float16"),
        ("attention_dropout", 0.1),
        ("quantization_config", {"quant_method": "fp8"}),
    ],
)
def test_unsupported_field_is_named(field, value):
    hf = copy.deepcopy(QWEN3_0P6B)
    hf[field] = value
    with pytest.raises(UnsupportedHFConfig, match=field):
        model_config_from_hf(hf)


@pytest.mark.parametrize(("model_type", "family"), [("qwen3_moe", "qwen3_moe"), ("qwen3_next", "qwen3_next")])
def test_later_families_are_recognised_but_refused(model_type, family):
    with pytest.raises(
        UnsupportedHFConfig, match=f"model_type='{model_type}' \\(family '{family}'\\).*not supported yet"
    ):
        model_config_from_hf({**QWEN3_0P6B, "model_type": model_type})
    assert model_type not in supported_model_types()


def test_unknown_model_type_lists_known_ones():
    with pytest.raises(UnsupportedHFConfig, match="model_type='llama'.*known: .*'qwen3'"):
        model_config_from_hf({**QWEN3_0P6B, "model_type": "llama"})
