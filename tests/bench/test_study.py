"""``iso-bench study`` end to end on tiny_moe (the tiny model whose performance profile shows a gap on the CPU), with
W&B offline: the study's files, both runs' per-token logs and the W&B media; and its argument errors."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import types
from pathlib import Path

import pytest

from megatron_iso.bench.study import PROFILES, GpuSampler, StudySettingsError, overhead_pct, plan_study, summarize
from megatron_iso.rl.token_log import WORST_COLUMNS, WORST_TOKENS
from megatron_iso.testing.cli_process import run_python

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model=tiny_moe", "task.prompts_per_step=2", "rl.group_size=4", "rl.max_response_length=6"]
SUMMARY_KEYS = {
    "steps", "timed_steps", "dlogp_mean", "dlogp_p50", "dlogp_p95", "dlogp_p99", "dlogp_max", "dlogp_step_max_mean",
    "bitwise_equal_frac", "reward_mean", "reward_last", "kl_k3", "clip_frac", "loss", "gen_s", "train_s", "step_s",
    "peak_mem_bytes", "gpu_util_pct",
}  # fmt: skip


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_token_logs(run: Path) -> None:
    """worst_tokens.jsonl and dlogp_hist.jsonl against the run's own metrics, step by step."""
    metrics = {r["step"]: r for r in _jsonl(run / "metrics.jsonl")}
    hists = {h["step"]: h for h in _jsonl(run / "dlogp_hist.jsonl")}
    worst = _jsonl(run / "worst_tokens.jsonl")
    assert sorted(hists) == sorted(metrics)
    for step, m in metrics.items():
        h = hists[step]
        assert sum(h["counts"]) == h["tokens"] > 0 and len(h["log10_edges"]) == len(h["counts"]) + 1
        assert h["zero"] == round(h["tokens"] * m["mismatch/bitwise_equal_frac"])  # zero gap <=> equal bits here
        rows = [r for r in worst if r["step"] == step]
        assert len(rows) == min(WORST_TOKENS, h["tokens"]) and set(rows[0]) == set(WORST_COLUMNS)
        gaps = [r["abs_dlogp"] for r in rows]
        assert gaps == sorted(gaps, reverse=True) and gaps[0] == m["mismatch/abs_diff_max"]  # the same max, exactly
        for r in rows:
            assert r["abs_dlogp"] == abs(r["trainer_logp"] - r["rollout_logp"])
            assert 0 <= r["position"] < m["response/length_max"] and 0 <= r["token_id"] < 256


def test_study_end_to_end_with_wandb_offline(tmp_path):
    out = tmp_path / "study"
    args = ["-m", "megatron_iso.cli.bench", "study", *SMALL, "bench.study.steps=2", "device=cpu",
            "logger=wandb", f"out_dir={out}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = run_python(args, cwd=tmp_path, env=env, pythonpath=[REPO], timeout=300)  # forked: no fresh imports
    assert proc.returncode == 0, proc.stderr[-4000:]

    md = (out / "study.md").read_text()
    assert md in proc.stdout  # the table on the console is the file's
    header = next(line for line in md.splitlines() if line.startswith("| profile |"))
    assert "overhead" in header and "max \\|dlogp\\|" in header and "GPU util" in header
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    col = header.split(" | ").index("overhead")
    assert re.fullmatch(r"[+-]\d+\.\d%", rows["correctness"][col]) and rows["performance"][col] == "baseline"
    assert rows["correctness"][header.split(" | ").index("max \\|dlogp\\|")] == "0"
    assert rows["performance"][-1] == "n/a |"  # GPU utilisation on the CPU

    doc = json.loads((out / "study.json").read_text())
    assert set(doc) == {"model", "device", "study", "environment", "runs", "overhead_pct", "files"}
    assert doc["model"] == "tiny_moe" and doc["device"] == "cpu" and doc["study"]["steps"] == 2
    env = doc["environment"]
    assert env["device_name"].startswith("CPU, ") and env["commit"]  # the table says what ran it, on which code
    assert f"Device: {env['device_name']}; commit `{env['commit']}`" in md and "`model=tiny_moe " in md
    assert set(doc["runs"]) == set(PROFILES) and set(doc["overhead_pct"]) == {"gen_s", "train_s", "step_s"}
    corr, perf = (doc["runs"][p]["summary"] for p in PROFILES)
    assert set(corr) == set(perf) == SUMMARY_KEYS
    assert corr["steps"] == perf["steps"] == 2 and corr["timed_steps"] == 1  # step 0: warm-up
    # The claim, bit for bit: no token of any correctness step moved; the performance profile's moved.
    assert corr["dlogp_max"] == 0.0 and corr["bitwise_equal_frac"] == 1.0
    assert all(s["mismatch/abs_diff_max"] == 0.0 for s in doc["runs"]["correctness"]["steps"])
    assert perf["dlogp_max"] > 0.0 and perf["bitwise_equal_frac"] < 1.0
    assert doc["overhead_pct"]["step_s"] == pytest.approx(100 * (corr["step_s"] - perf["step_s"]) / perf["step_s"])
    png = (out / "study.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    for profile in PROFILES:
        run = out / profile
        _check_token_logs(run)
        media = run / "wandb" / "latest-run" / "files" / "media"
        dash = list((media / "images").glob("dashboard_*.png"))
        assert len(dash) == 1 and dash[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", profile
        tables = sorted((media / "table" / "mismatch").glob("worst_tokens_*.table.json"))
        assert len(tables) == 2, profile
        logged = json.loads(tables[0].read_text())
        assert logged["columns"] == list(WORST_COLUMNS)
        first = [[r[c] for c in WORST_COLUMNS] for r in _jsonl(run / "worst_tokens.jsonl") if r["step"] == 0]
        step0 = next(t for t in tables if json.loads(t.read_text())["data"][0][0] == 0)
        assert json.loads(step0.read_text())["data"] == first
        records = next((run / "wandb" / "latest-run").glob("*.wandb")).read_bytes()
        assert b"mismatch/abs_diff_log10_hist" in records and b'"histogram"' in records, profile
    assert all(r["abs_dlogp"] == 0.0 for r in _jsonl(out / "correctness" / "worst_tokens.jsonl"))
    study_media = out / "wandb" / "latest-run" / "files" / "media"
    assert list((study_media / "table" / "study").glob("table_*.table.json"))
    assert list((study_media / "images" / "study").glob("plot_*.png"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["profile=performance"], "'profile=performance' is not allowed: the study runs both profiles"),
        (["rl.steps=4"], "'rl.steps=4' is not allowed: set bench.study.steps instead"),
        (["--fast"], "unknown flag '--fast'"),
        (["bench.study.steps=0"], r"bench.study.steps=0 is not allowed; allowed values: integers >= 1"),
        (["bench.study.warmup_steps=-1"], r"bench.study.warmup_steps=-1 is not allowed; allowed values: integers >= 0"),
        (["rl.group_size=0"], r"the correctness run: rl.group_size=0"),
    ],
)
def test_bad_study_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    with pytest.raises(StudySettingsError, match=re.escape(message) if "\\" not in message else message):
        plan_study([*args, f"out_dir={tmp_path / 'study'}"])
    assert not (tmp_path / "study").exists()


def test_a_study_never_overwrites_another(tmp_path):
    (tmp_path / "study.json").write_text("{}")
    with pytest.raises(StudySettingsError, match="already holds study.json"):
        plan_study([f"out_dir={tmp_path}"])


def test_bad_argument_exits_2_with_one_line(tmp_path):
    proc = run_python(["-m", "megatron_iso.cli.bench", "study", "profile=performance"], cwd=tmp_path,
                      pythonpath=[REPO], timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "iso-bench study: error: 'profile=performance' is not allowed: the study runs both profiles"
    ]
    assert not list(tmp_path.iterdir())


def test_summary_and_overhead_by_hand():
    rows = [
        {"step": 0, "timing/step_s": 9.0, "timing/gen_s": 5.0, "timing/train_s": 4.0, "mismatch/abs_diff_max": 2e-7,
         "mismatch/abs_diff_mean": 1e-8, "reward/mean": 0.25, "loss": "nan", "memory/peak_bytes": 100.0},
        {"step": 1, "timing/step_s": 3.0, "timing/gen_s": 2.0, "timing/train_s": 1.0, "mismatch/abs_diff_max": 4e-7,
         "mismatch/abs_diff_mean": 3e-8, "reward/mean": 0.75, "loss": 0.5, "memory/peak_bytes": 300.0},
    ]  # fmt: skip
    s = summarize(rows, warmup_steps=1)
    assert s["step_s"] == 3.0 and s["gen_s"] == 2.0 and s["timed_steps"] == 1  # step 0 out of the timings
    assert s["dlogp_max"] == 4e-7 and s["dlogp_step_max_mean"] == pytest.approx(3e-7)
    assert s["dlogp_mean"] == pytest.approx(2e-8) and s["reward_mean"] == 0.5 and s["reward_last"] == 0.75
    assert s["loss"] == 0.5 and s["peak_mem_bytes"] == 300.0  # a "nan" string is left out
    assert s["kl_k3"] is None and s["dlogp_p95"] is None  # not logged: None, "-" in the table
    assert summarize(rows, warmup_steps=5)["step_s"] == 6.0  # no step left after the warm-up: all count
    base = {"gen_s": 1.0, "train_s": 2.0, "step_s": 4.0}
    assert overhead_pct({"gen_s": 1.5, "train_s": 1.0, "step_s": 4.0}, base) == {
        "gen_s": 50.0,
        "train_s": -50.0,
        "step_s": 0.0,
    }
    assert overhead_pct({"gen_s": None, "train_s": 1.0, "step_s": 1.0}, {**base, "train_s": 0.0})["gen_s"] is None


def test_gpu_utilisation_is_read_through_nvml_or_not_at_all(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    seen = []
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: seen.append(i) or "h",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=42),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with GpuSampler("cuda", period_s=0.01) as gpu:
        time.sleep(0.05)
    assert gpu.mean() == 42.0 and seen == [3]  # the first visible device: the one the runs use
    with GpuSampler("cpu") as cpu:
        pass
    assert cpu.mean() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with GpuSampler("cuda") as missing:
        pass
    assert missing.mean() is None
