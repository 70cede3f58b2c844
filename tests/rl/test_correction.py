"""rl.rollout_correction: each mode and level against a hand-computed example, and exactly 1 where the rollout's
logprobs are the trainer's (the correctness profile)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_iso.rl.correction import correction_stats, correction_weights, level_log_ratio
from megatron_iso.rl.losses import PolicyLossConfig, policy_loss
from megatron_iso.settings import SettingsError, resolve
from megatron_iso.settings.compose import load_config
from megatron_iso.settings.correction import CORRECTION_LEVELS, RolloutCorrection
from megatron_iso.testing.bits import bits

# Two responses, then a prompt row: response 0 has log ratios 0.5, -0.25, 1.25 (sum 1.5, mean 0.5), response 1
# has -0.5, 0.25 (sum -0.25, mean -0.125). All are exact in fp32.
LOG_RATIO = [0.5, -0.25, 1.25, -0.5, 0.25, 0.0]
MASK = torch.tensor([True, True, True, True, True, False])
SEQ = torch.tensor([0, 0, 0, 1, 1, 1])
E = math.exp


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = torch.tensor([-1.0, -2.0, -3.0, -1.0, -2.0, 0.0])
    return rollout + torch.tensor(LOG_RATIO), rollout


# (mode, level, upper, expected weights of the 5 response tokens); lower is 1 / upper.
CASES = [
    ("truncate", "token", 2.0, [E(0.5), E(-0.25), 2.0, E(-0.5), E(0.25)]),
    ("mask", "token", 2.0, [1, 1, 0, 1, 1]),  # e^1.25 = 3.49 > 2
    ("icepop", "token", 2.0, [E(0.5), E(-0.25), 0, E(-0.5), E(0.25)]),
    ("truncate", "sequence", 2.0, [2.0, 2.0, 2.0, E(-0.25), E(-0.25)]),  # e^1.5 = 4.48 capped
    ("mask", "sequence", 2.0, [0, 0, 0, 1, 1]),  # response 0 leaves the band as a whole
    ("icepop", "sequence", 2.0, [0, 0, 0, E(-0.25), E(-0.25)]),
    ("truncate", "geometric", 2.0, [E(0.5)] * 3 + [E(-0.125)] * 2),
    ("mask", "geometric", 1.5, [0, 0, 0, 1, 1]),  # e^0.5 = 1.65 > 1.5; e^-0.125 = 0.88 > 1 / 1.5
    ("icepop", "geometric", 1.5, [0, 0, 0, E(-0.125), E(-0.125)]),
]


@pytest.mark.parametrize(("mode", "level", "upper", "expected"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_weights_and_metrics_match_the_hand_computed_example(mode, level, upper, expected):
    old, rollout = _inputs()
    cfg = RolloutCorrection(mode=mode, level=level, upper=upper)
    weight, rejected = correction_weights(old, rollout, MASK, SEQ, cfg)
    assert weight.dtype == torch.float32 and float(weight[5]) == 0.0  # the prompt row carries nothing
    assert weight[:5].tolist() == pytest.approx(expected, rel=1e-6)
    zeros = [w == 0 for w in expected]
    assert rejected[:5].tolist() == (zeros if mode == "mask" else [False] * 5)
    stats = correction_stats(weight, MASK)
    n, total, squares = len(expected), sum(expected), sum(w * w for w in expected)
    assert stats["rollout_correction/masked_frac"] == sum(zeros) / n
    assert stats["rollout_correction/weight_mean"] == pytest.approx(total / n, rel=1e-6)
    assert stats["rollout_correction/weight_max"] == pytest.approx(max(expected), rel=1e-6)
    assert stats["rollout_correction/ess"] == pytest.approx(total * total / (n * squares), rel=1e-6)


def test_sequence_ratio_is_summed_in_log_space():
    # 200 tokens of log ratio 5 each: the product e^1000 overflows float64; the log-space sum is bounded to e^20.
    n = 200
    old, rollout = torch.full((n,), 4.0), torch.full((n,), -1.0)
    mask, seq = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    log_ratio = level_log_ratio(old, rollout, mask, seq, "sequence")
    assert torch.equal(log_ratio, torch.full((n,), 20.0, dtype=torch.float64))
    weight, _ = correction_weights(old, rollout, mask, seq, RolloutCorrection("truncate", "sequence", upper=3.0))
    assert torch.equal(weight, torch.full((n,), 3.0))


def test_mask_removes_rejected_tokens_from_the_loss_and_its_normaliser():
    old, rollout = _inputs()
    adv = torch.tensor([1.0, 0.5])
    loss_of = {}
    for mode in ("off", "mask", "icepop"):
        cfg = PolicyLossConfig(aggregation="token_mean", correction=RolloutCorrection(mode=mode))
        loss_of[mode], _ = policy_loss(old, old, adv, MASK, SEQ, cfg, rollout_logp=rollout)
    # logp = old: every PPO ratio is 1, each response token's term is -advantage times its weight.
    assert float(loss_of["off"]) == pytest.approx(-(3 * 1.0 + 2 * 0.5) / 5)
    assert float(loss_of["mask"]) == pytest.approx(-(2 * 1.0 + 2 * 0.5) / 4)  # token 2 rejected: 4 remain
    icepop = -(E(0.5) + E(-0.25) + 0.5 * (E(-0.5) + E(0.25))) / 5  # token 2 weighted 0, still counted
    assert float(loss_of["icepop"]) == pytest.approx(icepop, rel=1e-6)
    # seq_mean_token_mean: a response rejected as a whole leaves the sequence count too.
    cfg = PolicyLossConfig(correction=RolloutCorrection("mask", "sequence"))
    loss, _ = policy_loss(old, old, adv, MASK, SEQ, cfg, rollout_logp=rollout)
    assert float(loss) == pytest.approx(-0.5)


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("mode", ["truncate", "mask", "icepop"])
def test_equal_logprobs_give_weights_of_exactly_one(mode, level):
    """The correctness profile: the old logprobs are the rollout's bit for bit, so every weight is exactly 1.0,
    nothing is masked, and the loss is the uncorrected loss bit for bit."""
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(64, generator=g) * 5
    old = rollout.clone()
    logp = (old + torch.randn(64, generator=g) * 0.1).requires_grad_()
    mask = torch.rand(64, generator=g) > 0.2
    seq = torch.arange(64) // 9
    adv = torch.randn(8, generator=g)
    cfg = RolloutCorrection(mode=mode, level=level, lower=0.999, upper=1.001)
    weight, rejected = correction_weights(old, rollout, mask, seq, cfg)
    assert torch.equal(bits(weight[mask]), bits(torch.ones(int(mask.sum()))))
    assert not rejected.any()
    stats = correction_stats(weight, mask)
    assert stats["rollout_correction/masked_frac"] == 0.0
    assert stats["rollout_correction/weight_mean"] == stats["rollout_correction/weight_max"] == 1.0
    assert stats["rollout_correction/ess"] == 1.0
    on, _ = policy_loss(logp, old, adv, mask, seq, PolicyLossConfig(correction=cfg), rollout_logp=rollout)
    off, _ = policy_loss(logp, old, adv, mask, seq, PolicyLossConfig())
    assert torch.equal(bits(on.detach()), bits(off.detach()))


def test_settings_name_the_field_and_tis_cap_is_truncate():
    with pytest.warns(FutureWarning, match="rl.rollout_correction.mode=truncate"):
        rl = resolve(load_config(["rl.tis_cap=3.0"])).rl
    assert rl.rollout_correction == RolloutCorrection("truncate", "token", None, 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the YAML's default: no deprecation warning
        assert resolve(load_config([])).rl.rollout_correction == RolloutCorrection()
    bad = {
        "rl.rollout_correction.mode=clip": r"rl.rollout_correction.mode='clip' .*\['off', 'truncate', 'mask', 'icepop'\]",
        "rl.rollout_correction.level=batch": r"rl.rollout_correction.level='batch' .*\['token', 'sequence', 'geometric'\]",
        "rl.rollout_correction.upper=0.5": r"rl.rollout_correction.upper=0.5 .*>= 1",
        "rl.rollout_correction.lower=1.5": r"rl.rollout_correction.lower=1.5 .*\(0, 1\]",
    }
    for override, message in bad.items():
        with pytest.raises(SettingsError, match=message):
            resolve(load_config([override]))
    with pytest.raises(SettingsError, match="rl.tis_cap is deprecated"):
        resolve(load_config(["rl.tis_cap=2.0", "rl.rollout_correction.mode=mask"]))


def _trainer_update(tmp_path, profile: str, overrides: list[str]) -> dict:
    """One RL step's update of a real trainer (tiny_moe: its performance profile moves logprobs on the CPU) with
    pi_old from a trainer forward, not copied from the rollout (``rl.recompute_old_logprobs=true``)."""
    from megatron_iso.parallel.world import seed_ranks
    from megatron_iso.rl.losses import group_advantages
    from megatron_iso.rl.ppo import merge_updates, run_updates
    from megatron_iso.rl.trainer import Trainer
    from megatron_iso.settings import config_world

    over = ["model=tiny_moe", f"profile={profile}", "rl.group_size=4", "rl.max_response_length=6",
            "task.prompts_per_step=2", "rl.recompute_old_logprobs=true", f"out_dir={tmp_path / profile}", *overrides]  # fmt: skip
    cfg = load_config(over)
    with config_world(cfg):
        seed_ranks(int(cfg.seed))
        trainer = Trainer(resolve(cfg), 0)
        samples = trainer.rollout(0)
        adv = group_advantages(trainer.score_rewards(samples), 4)
        out = merge_updates(run_updates(trainer, samples, adv, passes=1, filler=samples[0]))
    out["seq_index"] = torch.repeat_interleave(torch.arange(len(samples)), out["trained_lengths"])
    return out


def test_trainer_weights_are_exactly_one_in_the_correctness_profile_only(tmp_path):
    """The trainer's own pi_old against the rollout's logprobs. Correctness profile: every weight of every mode and
    level is 1.0 in its bit pattern, and ``mask`` with the band [1, 1] (any ratio but exactly 1 rejected) logs
    ``rollout_correction/masked_frac`` exactly 0. Performance profile: the same band rejects exactly the tokens whose
    two logprobs differ in their bits, and the token-level weights leave 1."""
    band = ["rl.rollout_correction.mode=mask", "rl.rollout_correction.upper=1.0"]
    for profile in ("correctness", "performance"):
        out = _trainer_update(tmp_path, profile, band)
        old, rollout, seq = out["trainer_logp"], out["rollout_logp"], out["seq_index"]
        every = torch.ones(old.numel(), dtype=torch.bool)
        assert old.numel() > 20
        moved = int((bits(old) != bits(rollout)).sum())
        n = old.numel()
        assert out["rollout_correction/masked_frac"] * n == pytest.approx(moved, abs=1e-6)
        weights = {
            (mode, level): correction_weights(old, rollout, every, seq, RolloutCorrection(mode, level, upper=2.0))[0]
            for mode in ("truncate", "mask", "icepop")
            for level in CORRECTION_LEVELS
        }
        if profile == "correctness":
            assert moved == 0 and out["rollout_correction/masked_frac"] == 0.0
            assert out["rollout_correction/weight_mean"] == out["rollout_correction/ess"] == 1.0
            for key, w in weights.items():
                assert torch.equal(bits(w), bits(torch.ones(n))), key
        else:
            assert 0 < moved < n, moved  # tiny_moe on the CPU: some tokens move, most do not
            assert not torch.equal(bits(weights["truncate", "token"]), bits(torch.ones(n)))
