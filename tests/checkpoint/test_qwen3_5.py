"""Qwen3.5 text (dense and MoE, plain and inside the multimodal wrapper) against transformers' own
classes: config both ways, bitwise export(import(x)) through TP=2 / EP=2, fused 3-D experts, fp32
logits within tolerance, errors naming the field or tensor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from megatron_iso.checkpoint import export_hf, import_hf, read_hf_weights
from megatron_iso.checkpoint.compare import compare_with_transformers
from megatron_iso.checkpoint.hf_config import UnsupportedHFConfig, hf_config_from_model, model_config_from_hf
from megatron_iso.settings.compose import conf_dir
from tests.checkpoint.conftest import FAMILIES, TINY_QWEN3_5_MOE
from tests.checkpoint.test_hf_checkpoint import REL_TOL, _rewrite, assert_same_tensors

VL_PREFIX = "model.language_model."


def _config(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_config_maps_both_ways_and_transformers_accepts_ours(family):
    import transformers

    config_cls, _, kwargs = FAMILIES[family]
    hf = getattr(transformers, config_cls)(**kwargs).to_dict()
    model = model_config_from_hf(hf, name="tiny")
    assert model["family"] == family and model["hf_gdn_layout"] == "split"
    assert model["full_attention_interval"] == 2 and model["rotary_fraction"] == 0.25
    assert model["zero_centered_norm"] and model["attention_output_gate"]
    back = hf_config_from_model(model)
    assert model_config_from_hf(back, name="tiny") == model
    ours = getattr(transformers, config_cls)(**{k: v for k, v in back.items() if k != "architectures"})
    assert ours.layer_types == hf["layer_types"] and ours.linear_num_value_heads == hf["linear_num_value_heads"]
    if family == "qwen3_5_moe":
        assert model["norm_topk_prob"] and model["shared_expert_gate"] and model["num_experts"] == 4


def test_shipped_35b_a3b_conf_has_a_qwen3_5_moe_form():
    model = yaml.safe_load((conf_dir() / "model" / "qwen3p5_35b_a3b.yaml").read_text())
    hf = hf_config_from_model(model)
    assert hf["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in hf
    assert {**model_config_from_hf(hf, name=model["name"]), "init_from": None} == model


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),  # Qwen3.5-MoE's router has no such switch
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ],
)
def test_unsupported_fields_are_refused_naming_the_field(edit, field):
    import transformers

    hf = transformers.Qwen3_5MoeTextConfig(**TINY_QWEN3_5_MOE).to_dict() | edit
    with pytest.raises(UnsupportedHFConfig, match=re.escape(field)):
        model_config_from_hf(hf)


def test_multimodal_text_config_must_match_the_wrapper():
    hf = {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_text"}}
    with pytest.raises(UnsupportedHFConfig, match=r"text_config.model_type='qwen3_5_text'.*\['qwen3_5_moe_text'\]"):
        model_config_from_hf(hf)
    with pytest.raises(UnsupportedHFConfig, match="fields \\['mm_projector'\\]"):
        model_config_from_hf({"model_type": "qwen3_5", "text_config": {}, "mm_projector": 1})


@pytest.mark.parametrize(("fixture", "tp", "ep"), [("hf_qwen3_5", 2, 1), ("hf_qwen3_5_moe", 2, 2)])
def test_export_of_import_is_bitwise(request, tmp_path, fixture, tp, ep):
    hf_dir = request.getfixturevalue(fixture)
    manifest = import_hf(hf_dir, tmp_path / "ckpt", tp=tp, ep=ep)
    assert manifest["layout"] == {"tp": tp, "ep": ep}
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_tensors(read_hf_weights(hf_dir), read_hf_weights(tmp_path / "out"))
    assert _config(tmp_path / "out") == _config(hf_dir)


@pytest.mark.parametrize("fixture", ["hf_qwen3_5_vl", "hf_qwen3_5_moe_vl"])
def test_multimodal_checkpoint_exports_its_text_model_bitwise(request, tmp_path, fixture):
    """The text part of a multimodal checkpoint: its tensors (renamed out of model.language_model.) come back
    bit for bit as a text model that transformers' *ForCausalLM loads; the vision tower is dropped."""
    from transformers import AutoConfig

    hf_dir = request.getfixturevalue(fixture)
    manifest = import_hf(hf_dir, tmp_path / "ckpt", tp=2, ep=2 if "moe" in fixture else 1)
    src = read_hf_weights(hf_dir)
    assert manifest["hf"]["dropped_tensors"] == sorted(n for n in src if n.startswith("model.visual."))
    text = {("model." + n[len(VL_PREFIX) :] if n.startswith(VL_PREFIX) else n): t for n, t in src.items()}
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_tensors(
        {n: t for n, t in text.items() if not n.startswith("model.visual.")}, read_hf_weights(tmp_path / "out")
    )
    config = _config(tmp_path / "out")
    assert config == {**_config(hf_dir)["text_config"], "architectures": config["architectures"]}
    assert AutoConfig.from_pretrained(tmp_path / "out").model_type == _config(hf_dir)["text_config"]["model_type"]


@pytest.fixture(scope="module")
def hf_qwen3_5_moe_fused(tmp_path_factory) -> Path:
    """Experts stored fused (3-D mlp.experts.gate_up_proj / down_proj), as real Qwen3.5-MoE checkpoints ship:
    transformers' in-memory state dict, written as is."""
    import transformers

    torch.manual_seed(11)
    config = transformers.Qwen3_5MoeTextConfig(**TINY_QWEN3_5_MOE)
    model = transformers.Qwen3_5MoeForCausalLM(config)
    out = tmp_path_factory.mktemp("hf_qwen3_5_moe_fused")
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    return out


def test_fused_experts_round_trip_bitwise(hf_qwen3_5_moe_fused, tmp_path):
    manifest = import_hf(hf_qwen3_5_moe_fused, tmp_path / "ckpt", tp=2, ep=2)
    assert manifest["hf"]["fused_experts"]
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_tensors(read_hf_weights(hf_qwen3_5_moe_fused), read_hf_weights(tmp_path / "out"))


# Measured max_rel_diff 1.3e-6 .. 2.9e-6 (fp32; same reasons as Qwen3-Next: summation order).
@pytest.mark.parametrize(
    "fixture", ["hf_qwen3_5", "hf_qwen3_5_moe", "hf_qwen3_5_vl", "hf_qwen3_5_moe_vl", "hf_qwen3_5_moe_fused"]
)
def test_fp32_logits_match_transformers(request, fixture):
    result = compare_with_transformers(request.getfixturevalue(fixture), seed=1, length=24)
    print(f"{fixture}: {result}")
    assert result["argmax_agreement"] == 1.0
    assert result["max_rel_diff"] < REL_TOL, result
    assert result["max_abs_logprob_diff"] < 1e-4, result


def test_swapped_gdn_projection_is_detected(hf_qwen3_5, tmp_path):
    """in_proj_b and in_proj_a have the same shape: swapping them must show in the logits."""
    from megatron_iso.checkpoint import compare as cmp_mod

    def swap(w):
        p = "model.layers.0.linear_attn."
        w[p + "in_proj_b.weight"], w[p + "in_proj_a.weight"] = w[p + "in_proj_a.weight"], w[p + "in_proj_b.weight"]

    bad = _rewrite(hf_qwen3_5, tmp_path / "bad", swap)
    ids = torch.tensor([5, 7, 11, 3, 9])
    ours, _ = cmp_mod._ours(hf_qwen3_5, [], ids)
    assert float((ours - cmp_mod._transformers(bad, ids)).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("name", "edit", "error", "message"),
    [
        ("model.layers.0.linear_attn.in_proj_z.weight", "drop", KeyError, "missing tensor"),
        ("model.layers.0.linear_attn.in_proj_qkv.weight", "cut", ValueError, "has shape [255, 64], expected [256, 64]"),
        ("model.layers.0.linear_attn.in_proj_qkvz.weight", "add", KeyError, "unexpected tensors"),
    ],
)
def test_bad_tensors_are_named(hf_qwen3_5, tmp_path, name, edit, error, message):
    def change(w):
        src = "model.layers.0.linear_attn.in_proj_qkv.weight"
        if edit == "drop":
            w.pop(name)
        elif edit == "cut":
            w[name] = w[name][:-1].clone()
        else:
            w[name] = w[src].clone()

    bad = _rewrite(hf_qwen3_5, tmp_path / "bad", change)
    with pytest.raises(error, match=re.escape(name) + ".*" if edit != "add" else re.escape(message)):
        import_hf(bad, tmp_path / "ckpt")
