"""HF config.json -> conf/model: the mapping, and errors that name the unsupported field."""

from __future__ import annotations

import copy

import pytest

from megatron_iso.checkpoint.hf_config import (
    UnsupportedHFConfig,
    hf_config_from_model,
    model_config_from_hf,
    supported_model_types,
)
from megatron_iso.settings.compose import load_config

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
    assert {**ours, "init_from": None} == shipped  # a shipped group starts from random weights


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


# Qwen/Qwen3-30B-A3B's config.json (transformers 4 era).
QWEN3_30B_A3B = {
    **{k: v for k, v in QWEN3_0P6B.items() if k not in ("max_window_layers",)},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}
# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (transformers 4 era: full_attention_interval and a
# top-level partial_rotary_factor instead of layer_types / rope_parameters).
QWEN3_NEXT_80B_A3B = {
    **{k: v for k, v in QWEN3_30B_A3B.items() if k not in ("max_window_layers", "sliding_window")},
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "full_attention_interval": 4,
    "head_dim": 256,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512,
}


@pytest.mark.parametrize(
    ("hf", "shipped"), [(QWEN3_30B_A3B, "qwen3_30b_a3b"), (QWEN3_NEXT_80B_A3B, "qwen3_next_80b_a3b")]
)
def test_moe_and_hybrid_configs_map_to_the_shipped_model_configs(hf, shipped):
    from omegaconf import OmegaConf

    ours = model_config_from_hf(hf, name=shipped)
    assert {**ours, "init_from": None} == OmegaConf.to_container(load_config([f"model={shipped}"]).model)
    # Back to HF and into transformers' own config class: the same model again.
    import transformers

    back = hf_config_from_model(ours)
    assert model_config_from_hf(back, name=shipped) == ours
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen3_next": transformers.Qwen3NextConfig}[hf["model_type"]]
    cfg = cls(**{k: v for k, v in back.items() if k not in ("architectures", "model_type")})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
        hf["num_experts"],
        hf["num_experts_per_tok"],
        True,
    )
    if hf["model_type"] == "qwen3_next":
        assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + cfg.layer_types[4:]
        assert cfg.layer_types.count("full_attention") == 12 and cfg.rope_parameters["partial_rotary_factor"] == 0.25


def test_transformers5_qwen3_next_config_and_dense_hybrid():
    hf = {k: v for k, v in QWEN3_NEXT_80B_A3B.items() if k not in ("full_attention_interval", "partial_rotary_factor")}
    hf |= {
        "num_hidden_layers": 6,
        "layer_types": ["linear_attention", "full_attention"] * 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5},
    }
    model = model_config_from_hf(hf, name="x")
    assert (model["full_attention_interval"], model["rotary_fraction"]) == (2, 0.5)
    dense = model_config_from_hf({**hf, "num_experts": 0}, name="x")  # HF: a dense MLP in every layer
    assert "num_experts" not in dense and dense["ffn_hidden_size"] == 5120
    assert hf_config_from_model(dense)["num_experts"] == 0
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
    moe = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 64}
    assert model_config_from_hf(moe)["num_experts"] == 64


@pytest.mark.parametrize(
    ("base", "field", "value"),
    [
        (QWEN3_30B_A3B, "decoder_sparse_step", 2),
        (QWEN3_30B_A3B, "mlp_only_layers", [0, 1]),
        (QWEN3_30B_A3B, "num_experts_per_tok", 129),
        (QWEN3_30B_A3B, "layer_types", ["sliding_attention"] * 48),
        (QWEN3_30B_A3B, "attention_bias", True),
        (QWEN3_30B_A3B, "shared_expert_intermediate_size", 512),  # not a Qwen3-MoE field
        (QWEN3_NEXT_80B_A3B, "decoder_sparse_step", 2),
        (QWEN3_NEXT_80B_A3B, "mlp_only_layers", [3]),
        (QWEN3_NEXT_80B_A3B, "layer_types", ["linear_attention", "full_attention", "full_attention"] + ["x"] * 45),
        (QWEN3_NEXT_80B_A3B, "full_attention_interval", 0),
        (QWEN3_NEXT_80B_A3B, "linear_num_value_heads", 24),
        (QWEN3_NEXT_80B_A3B, "shared_expert_intermediate_size", 0),
        (QWEN3_NEXT_80B_A3B, "partial_rotary_factor", 0.0),
        (QWEN3_NEXT_80B_A3B, "rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
        (QWEN3_NEXT_80B_A3B, "hidden_act", "gelu"),
        (QWEN3_NEXT_80B_A3B, "quantization_config", {"quant_method": "fp8"}),
    ],
)
def test_unsupported_moe_or_hybrid_field_is_named(base, field, value):
    with pytest.raises(UnsupportedHFConfig, match=field):
        model_config_from_hf({**base, field: value})


def test_model_configs_without_an_hf_form_are_refused_naming_the_field():
    from omegaconf import OmegaConf

    tiny_moe = OmegaConf.to_container(load_config(["model=tiny_moe"]).model)  # qwen3_moe + a shared expert
    with pytest.raises(UnsupportedHFConfig, match="shared_expert_ffn_hidden_size"):
        hf_config_from_model(tiny_moe)
    with pytest.raises(UnsupportedHFConfig, match="zero_centered_norm"):
        hf_config_from_model({**model_config_from_hf(QWEN3_NEXT_80B_A3B), "zero_centered_norm": False})
    hybrid = OmegaConf.to_container(load_config(["model=tiny_hybrid"]).model)
    assert {**model_config_from_hf(hf_config_from_model(hybrid), name="tiny_hybrid"), "init_from": None} == hybrid


def test_qwen3_5_families_are_supported():
    # Qwen3.5's own tests: tests/checkpoint/test_qwen3_5.py.
    assert {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"} <= set(
        supported_model_types()
    )


def test_unknown_model_type_lists_known_ones():
    with pytest.raises(UnsupportedHFConfig, match="model_type='llama'.*known: .*'qwen3'"):
        model_config_from_hf({**QWEN3_0P6B, "model_type": "llama"})
