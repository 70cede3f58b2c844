"""External reference: transformers' Qwen3-MoE on the same random weights gives our logits (fp32,
both profiles), through the HF checkpoint names (per-expert gate/up/down, ``mlp.gate``)."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.harness import run_on_ranks

OVERRIDES = ["model=tiny_moe", "model.shared_expert_ffn_hidden_size=null"]


def _hf_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        initializer_range=0.1,  # O(1) router logits: routing actually depends on the token
    )
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _checkpoint_names(model) -> dict[str, torch.Tensor]:
    """transformers keeps experts fused in memory; checkpoints name each expert's projections."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, f = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :f].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, f:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def _ours(overrides: list[str], weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.settings.compose import load_config

    tc = transformer_config(load_config(overrides))
    model = build_model(tc, weights).eval()
    with torch.no_grad():
        return model.forward_packed(*pack([ids]))


@pytest.mark.parametrize("profile", ["correctness", "performance"])
def test_fp32_logits_match_transformers_qwen3_moe(profile):
    hf = _hf_model()
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0]
    ours = run_on_ranks(_ours, 1, args=([*OVERRIDES, f"profile={profile}"], _checkpoint_names(hf), ids))[0]
    rel = float((ours - ref).abs().max() / ref.abs().max())
    print(f"tiny Qwen3-MoE {profile} vs transformers: max rel logit diff {rel:.2e}")
    assert rel < 1e-5 and torch.equal(ours.argmax(-1), ref.argmax(-1))
