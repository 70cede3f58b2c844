"""iso-bench's ``bench.cp`` axis: the grid sweeps context parallelism, a CP layout's trainer scores its share of the
pack and gathers the scores and full-vocab log-softmax back, and on the hybrid (Gated DeltaNet) model the CP 2 row's
mismatch against the rollout is exactly 0, with CP 1's trainer logprobs bit for bit. A bad degree is refused
before any rank starts, naming the layout and the field."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from megatron_iso.bench.grid import BenchSettings, Layout, layout_config, layouts, run_grid


def test_layouts_sweep_cp_and_each_cp_rank_is_a_rank_of_its_own():
    lays, _ = layouts(["correctness"], [1, 2], [1], [False], [1, 2])
    assert lays == [Layout("correctness", t, 1, False, c) for t in (1, 2) for c in (1, 2)]
    assert [lay.world_size for lay in lays] == [1, 2, 2, 4]
    assert [lay.name for lay in lays][:2] == ["correctness/tp1/ep1/sp0", "correctness/tp1/ep1/sp0/cp2"]
    assert layout_config(None, lays[1])["parallel"]["cp"] == 2
    with pytest.raises(ValueError, match=r"^bench\.cp=\[0\] is invalid; allowed: a non-empty list of ints >= 1$"):
        layouts(["correctness"], [1], [1], [False], [0])


def test_check_bench_refuses_a_cp_degree_the_trainer_cannot_run():
    from megatron_iso.cli.bench import CONFIG_NAME, BenchSettingsError, check_bench
    from megatron_iso.settings.compose import load_config

    with pytest.raises(
        BenchSettingsError,
        match=r"^layout correctness/tp1/ep1/sp0/cp3 of the grid \(.*bench\.cp=\[3\]\): parallel\.cp=3 is not allowed; "
        r"allowed values: \[1, 2, 4, 8\]$",
    ):
        check_bench(load_config(["bench.profiles=[correctness]", "bench.cp=[3]"], config_name=CONFIG_NAME))


@pytest.mark.slow
def test_hybrid_cp_2_row_has_zero_mismatch_and_cp_1_bits():
    from megatron_iso.settings.compose import load_config

    base = OmegaConf.to_container(load_config(["model=tiny_hybrid", "profile.gdn_chunk=4"]), resolve=True)
    lays, _ = layouts(["correctness"], [1], [1], [False], [1, 2])
    settings = BenchSettings(config=base, batches=(3,), new_tokens=5, kv_cache_mb=4)
    cp1, cp2 = run_grid(lays, settings)
    assert (cp1["cp"], cp2["cp"], cp2["world_size"]) == (1, 2, 2)
    assert cp2["tokens"] == cp1["tokens"] and cp2["generated_tokens"] == 15
    # Python floats hold the fp32 values exactly: == is bit equality here.
    assert cp2["trainer_logprobs"] == cp1["trainer_logprobs"] == cp2["rollout_logprobs"]
    assert cp2["dlogp_max"] == 0.0 and cp2["full_vocab_dlogp_max"] == 0.0 and cp2["bitwise_equal_frac"] == 1.0
