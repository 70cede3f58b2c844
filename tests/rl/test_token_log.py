"""Per-token mismatch detail (rl.token_log) on hand-made steps, and what MetricsLog hands W&B."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from omegaconf import OmegaConf

from megatron_iso.rl import metrics
from megatron_iso.rl.token_log import HIST_EDGES, _joined, token_detail, trained_token_ids, worst_tokens


def _parts() -> list[dict[str, torch.Tensor]]:
    """Two data-parallel ranks: rank 0 trains samples of 2 and 1 tokens, rank 1 one sample of 3 tokens."""
    r0 = {
        "rollout_logp": torch.tensor([-1.0, -2.0, -3.0]),
        "trainer_logp": torch.tensor([-1.0, -2.5, -3.0]),  # gap 0.5 at sample 0, position 1
        "token_ids": torch.tensor([7, 8, 9]),
        "trained_lengths": torch.tensor([2, 1]),
    }
    r1 = {
        "rollout_logp": torch.tensor([-0.5, -1.5, -2.5]),
        "trainer_logp": torch.tensor([-0.5, -1.5 + 2**-20, -2.5 - 2**-20]),  # two equal gaps 2^-20 ~ 9.5e-7
        "token_ids": torch.tensor([10, 11, 12]),
        "trained_lengths": torch.tensor([3]),
    }
    return [r0, r1]


def test_worst_tokens_and_histogram_by_hand():
    worst, hist = token_detail(5, _parts())
    assert [(r["sequence"], r["position"], r["token_id"], r["abs_dlogp"]) for r in worst] == [
        (0, 1, 8, 0.5),
        (2, 1, 11, 2**-20),  # ties: the earlier token first
        (2, 2, 12, 2**-20),
        (0, 0, 7, 0.0),
        (1, 0, 9, 0.0),
        (2, 0, 10, 0.0),
    ]
    assert worst[0] | {"step": 5} == worst[0] and worst[0]["rollout_logp"] == -2.0 and worst[0]["trainer_logp"] == -2.5
    assert hist["tokens"] == 6 and hist["zero"] == 3 and hist["log10_edges"] == HIST_EDGES
    expected = [0] * (len(HIST_EDGES) - 1)
    expected[0] = 3  # the exact zeros
    expected[int((-6.0206 + 13) * 2)] = 2  # log10(2^-20) = -6.02: the bin [-6.5, -6.0)
    expected[int((-0.30103 + 13) * 2)] = 1  # log10(0.5) = -0.30: the bin [-0.5, 0.0)
    assert hist["counts"] == expected
    tokens = _joined(_parts())
    assert [r["token_id"] for r in worst_tokens(5, tokens, k=2)] == [8, 11]  # the top k only


def test_token_ids_follow_the_trained_samples():
    samples = [
        types.SimpleNamespace(tokens=[1, 2]),
        types.SimpleNamespace(tokens=[3]),
        types.SimpleNamespace(tokens=[4]),
    ]
    assert trained_token_ids(samples, torch.tensor([2, 1])).tolist() == [1, 2, 3]  # the first mini-batch: a prefix
    assert trained_token_ids(samples, torch.zeros(0, dtype=torch.long)).tolist() == []
    with pytest.raises(ValueError, match="not the first kept samples' lengths"):
        trained_token_ids(samples, torch.tensor([1]))


def test_metrics_log_writes_the_detail_and_gives_wandb_its_media(tmp_path, monkeypatch):
    logged, defined = [], []
    run = types.SimpleNamespace(
        summary={},
        finish=lambda: None,
        log=lambda data, step: logged.append((step, data)),
        define_metric=lambda name, **kw: defined.append((name, kw)),
    )
    fake = types.SimpleNamespace(
        init=lambda **kw: run,
        Table=lambda columns, data: ("table", columns, data),
        Histogram=lambda np_histogram: ("histogram", np_histogram),
        Image=lambda path: ("image", path),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = OmegaConf.create({"name": "wandb", "mode": "offline"})
    config = {"profile": {"name": "performance"}, "contract": {"numerical_policy": "f" * 64}}
    log = metrics.MetricsLog(tmp_path, cfg, config, resume_step=None, enabled=True)
    assert ("*", {"step_metric": "step"}) in defined and defined[0] == ("step", {})
    log.log(3, {"mismatch/abs_diff_max": 0.5, "reward/mean": 1.0}, _parts())
    step, data = logged[-1]
    assert step == 3 and data["step"] == 3 and data["reward/mean"] == 1.0
    table, hist = data["mismatch/worst_tokens"], data["mismatch/abs_diff_log10_hist"]
    assert table[0] == "table" and table[1][:3] == ["step", "sequence", "position"] and table[2][0][:4] == [3, 0, 1, 8]
    assert hist == ("histogram", (token_detail(3, _parts())[1]["counts"], HIST_EDGES))
    rows = [json.loads(line) for line in (tmp_path / "worst_tokens.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[0]["abs_dlogp"] == 0.5
    assert json.loads((tmp_path / "dlogp_hist.jsonl").read_text())["zero"] == 3
    png = log.write_dashboard()
    assert png == tmp_path / "dashboard.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert logged[-1] == (3, {"dashboard": ("image", str(png)), "step": 3})
    log.close()


def test_resume_rewinds_the_token_logs(tmp_path):
    cfg = OmegaConf.create({"name": "none"})
    log = metrics.MetricsLog(tmp_path, cfg, {}, resume_step=None, enabled=True)
    for step in range(3):
        log.log(step, {"loss": 0.0}, _parts())
    metrics.MetricsLog(tmp_path, cfg, {}, resume_step=1, enabled=True)
    assert {json.loads(line)["step"] for line in (tmp_path / "worst_tokens.jsonl").read_text().splitlines()} == {0}
    assert len((tmp_path / "dlogp_hist.jsonl").read_text().splitlines()) == 1
    moved = (tmp_path / "dlogp_hist.rewound.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved] == [1, 2]
