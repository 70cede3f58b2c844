"""``rollout.parallel.tp`` goes through the settings' one sharding check: every size TP splits, not only the KV
groups, with the allowed degrees among those that divide the world size."""

from __future__ import annotations

import pytest

from megatron_iso.settings import SettingsError, check_shardable, resolve, rollout_parallel
from megatron_iso.settings.compose import load_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model=qwen3_next_80b_a3b", "rollout.parallel.tp=4"],
            "rollout.parallel.tp=4 does not divide model.num_query_groups=2: Megatron cannot shard this model that "
            "way; allowed values: [1, 2]",
        ),
        # 4 KV groups shard at TP 4; the GDN key heads do not.
        (
            ["model=tiny_hybrid", "model.linear_num_key_heads=2", "rollout.parallel.tp=4"],
            "rollout.parallel.tp=4 does not divide model.linear_num_key_heads=2: Megatron cannot shard this model "
            "that way; allowed values: [1, 2]",
        ),
    ],
)
def test_rollout_tp_refused_by_the_shared_sharding_check(overrides, message):
    cfg = load_config(["device=cpu", *overrides])
    with pytest.raises(SettingsError) as info:
        rollout_parallel(resolve(cfg), world_size=4)
    assert str(info.value) == message
    model = dict(cfg.model)
    with pytest.raises(SettingsError) as same:  # the one check, called directly
        check_shardable(model, "tp", 4, "rollout.parallel.tp", candidates=[1, 2, 4])
    assert str(same.value) == message


def test_rollout_tp_that_shards_the_model_is_accepted():
    cfg = load_config(["device=cpu", "model=tiny_hybrid", "rollout.parallel.tp=4"])
    assert rollout_parallel(resolve(cfg), world_size=8) == {
        **dict(cfg.parallel),
        "tp": 4,
        "pp": 1,
        "sp": False,
        "dp": 2,
    }
