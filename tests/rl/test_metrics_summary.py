"""Step metrics users look at (response length, truncation, entropy) and the contract in the W&B summary."""

from __future__ import annotations

import sys
import types

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
