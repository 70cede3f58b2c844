"""conf/model/qwen3p5_small_hybrid_moe.yaml, the model of the hybrid GDN + MoE RL-step run on one H200
(docs/PERFORMANCE.md): its full-size contract validates for CUDA, its shapes meet the GPU kernels' tile
rules, its size matches the config's comment, and a shrunk copy runs tools/bench_rl_step.py on the CPU
with the iso rollout and trainer logprobs bitwise equal."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from megatron_iso.settings.compose import load_config

MODEL = "qwen3p5_small_hybrid_moe"
TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_rl_step.py"

# CPU size: same layer pattern (3 GDN layers, then gated attention), same block types and ratios (2 value
# heads per key head, 4 query heads per KV group, top-2 of 8 experts, gated shared expert), narrower.
# fp32 because Megatron's mixed-precision optimizer accepts bf16 parameters only on CUDA.
# gdn_chunk 4: prompt and generated tokens cross GDN chunk boundaries.
SHRINK = [
    "device=cpu",
    "model.params_dtype=fp32",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.ffn_hidden_size=64",
    "model.num_attention_heads=4",
    "model.kv_channels=32",
    "model.linear_num_key_heads=2",
    "model.linear_num_value_heads=4",
    "model.linear_key_head_dim=16",
    "model.linear_value_head_dim=16",
    "model.num_experts=8",
    "model.moe_topk=2",
    "model.moe_ffn_hidden_size=32",
    "model.shared_expert_ffn_hidden_size=64",
    "model.vocab_size=512",
    "profile.gdn_chunk=4",
]


def _full(*overrides: str):
    return load_config([f"model={MODEL}", *overrides])


@pytest.mark.parametrize("profile", ["correctness", "performance"])
def test_full_size_contract_validates_for_cuda(profile):
    from megatron_iso.settings import contract_for

    contract = contract_for(_full("device=cuda", f"profile={profile}"))
    policy, arch = contract.numerical_policy, contract.semantic.architecture
    assert policy.device_class == "cuda" and policy.profile == profile
    assert {e.device_class for e in policy.composition} == {"cuda"}
    ops = {e.op for e in policy.composition}
    assert {"gated_delta_rule", "attention", "grouped_gemm", "gemm", "logprob"} <= ops, ops
    assert arch["params_dtype"] == "bf16" and arch["hf_gdn_layout"] == "split"


def test_full_size_shapes_meet_gpu_tile_rules():
    """The rules the correctness profile's Triton kernels impose on CUDA (checked here on the config itself,
    so a config edit that breaks them fails on the CPU rather than mid-run on the GPU)."""
    import torch

    from megatron_iso.contract.build import row_parallel_ks
    from megatron_iso.ops.gemm.gemm_triton import CONFIGS

    cfg = _full()
    model, profile = cfg.model, cfg.profile
    block_k = CONFIGS[torch.bfloat16].block_k
    assert block_k == 64 and model.params_dtype == "bf16"
    leaves, expert_leaves = int(profile.leaves), int(profile.expert_leaves)
    ks = row_parallel_ks(model)
    ks.pop("model.vocab_size")  # the vocab log-sum-exp is no GEMM: 151936 / 8 leaves is fine
    assert set(ks) == {
        "model.hidden_size",
        "model.ffn_hidden_size",
        "model.shared_expert_ffn_hidden_size",
        "model.num_attention_heads*model.kv_channels",
        "model.linear_num_value_heads*model.linear_value_head_dim",
    }
    for name, k in ks.items():
        assert k % leaves == 0 and (k // leaves) % block_k == 0, f"{name}={k}: leaf depth {k / leaves}"
    assert model.moe_ffn_hidden_size % expert_leaves == 0
    assert (model.moe_ffn_hidden_size // expert_leaves) % block_k == 0
    assert model.hidden_size % block_k == 0  # column-parallel GEMMs: K = hidden in one leaf
    chunk = int(profile.gdn_chunk)
    assert chunk >= 16 and chunk & (chunk - 1) == 0
    # Qwen3.5 / Qwen3-Next geometry: GDN 16 key / 32 value heads of 128, attention heads of 256, top-k routing.
    assert (model.linear_num_key_heads, model.linear_num_value_heads) == (16, 32)
    assert model.linear_key_head_dim == model.linear_value_head_dim == 128 and model.kv_channels == 256
    assert model.num_layers % model.full_attention_interval == 0 and model.full_attention_interval == 4
    assert model.num_attention_heads % model.num_query_groups == 0 and model.moe_topk < model.num_experts


def test_full_size_parameter_count_matches_config_comment():
    """1.374B parameters (the config's comment); hf_shapes is what random_hf_state_dict draws and what
    loading checks against the built model, so it counts the model's parameters exactly."""
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import hf_shapes

    shapes = hf_shapes(transformer_config(_full()))
    total = sum(math.prod(s) for s in shapes.values())
    assert 1.373e9 < total < 1.375e9, total
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    assert 0.66e9 < total - experts * (1 - 4 / 32) < 0.68e9  # active per token with top-4 of 32


def _tool():
    spec = importlib.util.spec_from_file_location("bench_rl_step", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_rl_step_shrunk_iso_mismatch_zero(tmp_path):
    """Trainer micro-batches as the GPU step runs them (gpu_bench.sh rlhybrid): iso logprobs still exact."""
    out = tmp_path / "rl_step.json"
    argv = ["--model", MODEL, "--steps", "2", "--prompts", "2", "--group", "2", "--new-tokens", "6"]
    argv += ["--prompt-len", "8", "--kv-cache-mb", "16", "--train-micro-batch-seqs", "3", "--out", str(out), *SHRINK]
    assert _tool().main(argv) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == {} and report["model"] == MODEL
    assert report["args"]["train_micro_batch_seqs"] == 3  # 4 samples: micro-batches of 3 and 1
    by = {r["profile"]: r for r in report["results"]}
    assert set(by) == {"correctness", "performance"}
    iso = by["correctness"]
    assert len(iso["steps"]) == 2
    assert iso["mismatch_max"] == 0.0 and iso["bitwise_equal_frac"] == 1.0
    for step in iso["steps"]:
        assert step["mismatch/abs_diff_max"] == 0.0 and step["mismatch/bitwise_equal_frac"] == 1.0
    for r in by.values():
        assert len(r["steps"]) == 2 and r["step_s"] > 0 and r["gen_tokens_per_s"] > 0
