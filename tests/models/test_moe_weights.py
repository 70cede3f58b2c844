"""MoE weight names and sharding: Qwen3-30B-A3B's real parameter count; expert e on EP rank
e // (E/ep) as local expert e mod (E/ep); shared expert TP-split like a dense MLP."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_iso.models.transformer_config import transformer_config
from megatron_iso.models.weights import hf_shapes, megatron_shard, random_hf_state_dict
from megatron_iso.settings.compose import load_config


def test_qwen3_30b_a3b_shapes_have_the_published_parameter_counts():
    shapes = hf_shapes(transformer_config(load_config(["model=qwen3_30b_a3b"])))
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    active = total - experts + experts * 8 // 128
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 1) == 3.4  # "30.5B total, 3.3B activated"
    assert shapes["model.layers.47.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.0.mlp.experts.127.down_proj.weight"] == (2048, 768)


def test_expert_and_shared_expert_sharding():
    cfg = transformer_config(load_config(["model=tiny_moe"]))
    hf = random_hf_state_dict(cfg, seed=3)
    shard = megatron_shard(hf, cfg, rank=1, tp=2, ep_rank=1, ep=2)
    src, dst = "model.layers.1.mlp.", "decoder.layers.1.mlp."
    fc1 = torch.cat([hf[src + "experts.6.gate_proj.weight"], hf[src + "experts.6.up_proj.weight"]])
    assert torch.equal(shard[dst + "experts.local_experts.2.linear_fc1.weight"], fc1)  # expert 6 = 4 + 2
    assert torch.equal(shard[dst + "experts.local_experts.2.linear_fc2.weight"], hf[src + "experts.6.down_proj.weight"])
    assert not any(".local_experts.4." in n for n in shard)
    assert torch.equal(shard[dst + "router.weight"], hf[src + "gate.weight"])
    assert torch.equal(shard[dst + "shared_experts.gate_weight"], hf[src + "shared_expert_gate.weight"])
    assert torch.equal(
        shard[dst + "shared_experts.linear_fc2.weight"], hf[src + "shared_expert.down_proj.weight"][:, 32:]
    )


def test_ep_that_does_not_divide_the_experts_is_named():
    cfg = transformer_config(load_config(["model=tiny_moe"]))
    with pytest.raises(ValueError, match="parallel.ep=3"):
        megatron_shard(random_hf_state_dict(cfg), cfg, rank=0, tp=1, ep_rank=0, ep=3)


@pytest.mark.parametrize(
    ("overrides", "tp", "ep", "pattern"),
    [
        (["model=tiny_dense"], 1, 2, r"^parallel\.ep=2 does not apply to a dense model: .*allowed values: \[1\]$"),
        # Sizes the loader's own guard did not know: it failed later, on a tensor's rows, or in its GDN code.
        (
            ["model.vocab_size=255", "profile.leaves=1", "profile.tp_domain=[1]"],
            2,
            1,
            r"^parallel\.tp=2 does not divide model\.vocab_size=255: .*allowed values: \[1\]$",
        ),
        (
            ["model=tiny_hybrid", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4"],
            4,
            1,
            r"^parallel\.tp=4 does not divide model\.linear_num_key_heads=2: .*allowed values: \[1, 2\]$",
        ),
        (["model=tiny_moe"], 0, 1, r"^parallel\.tp=0 is not allowed; allowed values: integers >= 1$"),
    ],
)
def test_the_loader_checks_its_layout_with_the_settings_check(overrides, tp, ep, pattern):
    """megatron_shard / hf_from_megatron_shards take a layout from their caller (a tool or a test may shard one
    config's weights at any TP / EP): both refuse it with the settings' error (settings.check_shardable)."""
    from megatron_iso.models.weights import hf_from_megatron_shards
    from megatron_iso.settings import SettingsError

    cfg = transformer_config(load_config(overrides))
    hf = random_hf_state_dict(cfg)
    with pytest.raises(SettingsError, match=pattern):
        megatron_shard(hf, cfg, rank=0, tp=tp, ep_rank=0, ep=ep)
    if tp > 0:
        one = megatron_shard(hf, cfg, rank=0, tp=1)
        with pytest.raises(SettingsError, match=pattern):
            hf_from_megatron_shards([one] * (tp * ep), cfg, ep)


def test_sharded_sizes_are_the_model_groups_sizes():
    """models.transformer_config.sharded_sizes reads back, from a built config, every size settings.SHARDED_BY names, with the
    model group's value (tiny_hybrid_moe sets them all)."""
    from megatron_iso.models.transformer_config import sharded_sizes
    from megatron_iso.settings import SHARDED_BY

    cfg = load_config(["model=tiny_hybrid_moe"])
    sizes = sharded_sizes(transformer_config(cfg))
    assert set(sizes) == {name for names in SHARDED_BY.values() for name in names}
    assert sizes == {name: cfg.model[name] for name in sizes}
