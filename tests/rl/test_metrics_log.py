"""The metrics log and dashboard: valid JSON always, W&B falling back to offline, torn lines tolerated."""

from __future__ import annotations

import json
import sys
import types

import pytest
from omegaconf import OmegaConf

from megatron_iso.rl import metrics
from megatron_iso.rl.run_dir import RunDirError
from megatron_iso.settings import SettingsError


def test_non_finite_values_are_written_as_valid_json(tmp_path):
    log = metrics.MetricsLog(tmp_path, OmegaConf.create({"name": "none"}), {}, resume_step=None, enabled=True)
    log.log(0, {"grad_norm": float("nan"), "loss": float("inf"), "reward/mean": 0.5})
    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=pytest.fail)
    assert record == {"step": 0, "grad_norm": "nan", "loss": "inf", "reward/mean": 0.5}


def test_a_new_log_never_overwrites_an_existing_one(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunDirError, match="never overwrites"):
        metrics.MetricsLog(tmp_path, OmegaConf.create({"name": "none"}), {}, resume_step=None, enabled=True)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_online_wandb_without_a_server_falls_back_to_offline(tmp_path, monkeypatch, capsys):
    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics, "_wandb_reachable", lambda timeout_s=0: False)
    cfg = OmegaConf.create({"name": "wandb", "mode": "online"})
    metrics.MetricsLog(tmp_path, cfg, {"a": 1}, resume_step=None, enabled=True)
    assert seen["mode"] == "offline"
    assert "logging offline" in capsys.readouterr().err


def test_wandb_mode_is_checked(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace())
    cfg = OmegaConf.create({"name": "wandb", "mode": "sometimes"})
    with pytest.raises(SettingsError, match=r"logger.mode='sometimes' is not allowed; allowed values: \['offline'"):
        metrics.MetricsLog(tmp_path, cfg, {}, resume_step=None, enabled=True)


def test_dashboard_draws_a_log_with_a_torn_last_line(tmp_path):
    rows = [{"step": s, "reward/mean": s / 4, "mismatch/abs_diff_max": 0.0, "grad_norm": 1.0} for s in range(4)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew')
    out = metrics.write_dashboard(path, tmp_path / "dashboard.png", title="correctness · policy 1234abcd")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
