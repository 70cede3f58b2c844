"""Step metrics users look at (response length, truncation, entropy) and the contract in the W&B summary."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from omegaconf import OmegaConf

from megatron_iso.rl import metrics


def test_step_metrics_over_ranks():
    def part(trainer, rollout, trained, lengths, truncated, entropy, rewards):
        t = lambda x, d=torch.float32: torch.tensor(x, dtype=d)  # noqa: E731
        return {"trainer_logp": t(trainer), "rollout_logp": t(rollout), "trained_lengths": t(trained, torch.long),
                "lengths": t(lengths, torch.long), "truncated": t(truncated, torch.bool), "entropy": t(entropy),
                "rewards": t(rewards)}  # fmt: skip

    parts = [
        part([-1.0, -2.0], [-1.0, -2.0], [2], [2, 4], [False, True], [1.0, 2.0], [1.0, 0.0]),
        part([-0.5], [-0.5], [1], [1, 4], [False, True], [3.0], [0.0, 0.0]),
    ]
    m = metrics.step_metrics(parts, 0.2, 0.2)
    assert m["response/length_mean"] == 2.75 and m["response/length_max"] == 4.0
    assert m["response/truncated_frac"] == 0.5 and m["response_length/clip_ratio"] == 0.5
    assert m["policy/entropy"] == m["actor/entropy"] == 2.0
    assert m["reward/mean"] == 0.25 and m["mismatch/abs_diff_max"] == 0.0
    assert m["train/token_mult_prob_error"] == 1.0 and m["train/train_rollout_logprob_abs_diff"] == 0.0
    no_entropy = [dict(p, entropy=torch.zeros(0)) for p in parts]
    assert "policy/entropy" not in metrics.step_metrics(no_entropy, 0.2, 0.2)


def test_chi_square_and_perplexity_ratio_on_a_hand_computed_example():
    # Log ratios trainer - rollout: ln 2, 0, -ln 2 (ratios 2, 1, 1/2).
    ln2 = float(torch.tensor(2.0).log())
    rollout = torch.tensor([-1.0, -2.0, -3.0])
    trainer = rollout + torch.tensor([ln2, 0.0, -ln2])
    m = metrics.mismatch_metrics(rollout, trainer, 0.2, 0.2)
    assert m["mismatch/chi2"] == pytest.approx((4 + 1 + 0.25) / 3 - 1, rel=1e-6)  # E[r^2] - 1
    # exp(mean(-rollout)) / exp(mean(-trainer)): mean(-rollout) = 2, mean(-trainer) = 2 (the log ratios sum to 0).
    assert m["mismatch/ppl_ratio"] == pytest.approx(1.0, abs=1e-7)
    shifted = metrics.mismatch_metrics(rollout, rollout + 0.5, 0.2, 0.2)  # the trainer more confident everywhere
    assert shifted["mismatch/ppl_ratio"] == pytest.approx(float(torch.tensor(0.5).double().exp()), rel=1e-6)
    same = metrics.mismatch_metrics(rollout, rollout.clone(), 0.2, 0.2)
    assert same["mismatch/chi2"] == 0.0 and same["mismatch/ppl_ratio"] == 1.0  # exactly, as in the correctness profile


def test_mismatch_by_response_position_uses_quarters_of_each_response():
    # Responses of 4, 8 and 2 tokens; |dlogp| = the token's index in the batch, so each quarter's mean is known.
    lengths = torch.tensor([4, 8, 2])
    rollout = torch.zeros(14)
    trainer = -torch.arange(14, dtype=torch.float32)
    m = metrics.position_mismatch(rollout, trainer, lengths)
    # Quarter of each token: [0,1,2,3] | [0,0,1,1,2,2,3,3] | [0,2] (4 p // L).
    q1, q2, q3, q4 = [0, 4, 5, 12], [1, 6, 7], [2, 8, 9, 13], [3, 10, 11]
    assert m == {
        f"mismatch/abs_diff_mean_q{i + 1}": pytest.approx(sum(q) / len(q)) for i, q in enumerate([q1, q2, q3, q4])
    }
    single = metrics.position_mismatch(rollout[:1], trainer[:1], torch.tensor([1]))
    assert set(single) == {"mismatch/abs_diff_mean_q1"}  # empty quarters are not logged
    assert metrics.position_mismatch(torch.zeros(0), torch.zeros(0), torch.zeros(0)) == {}


def test_contract_identities_reach_the_wandb_config_and_summary(tmp_path, monkeypatch):
    seen = {}
    run = types.SimpleNamespace(summary={}, finish=lambda: None, log=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: seen.update(kw) or run))
    ids = {"semantic": "a" * 64, "numerical_policy": "b" * 64, "deployment": "c" * 64}
    cfg = OmegaConf.create({"name": "wandb", "mode": "offline"})
    log = metrics.MetricsLog(tmp_path, cfg, {"seed": 1, "contract": ids}, resume_step=None, enabled=True,
                             summary={"data/train_rows": 5})  # fmt: skip
    assert seen["config"]["contract"] == ids
    assert run.summary == {"contract/deployment": "c" * 64, "contract/numerical_policy": "b" * 64,
                           "contract/semantic": "a" * 64, "data/train_rows": 5}  # fmt: skip
    log.close()
