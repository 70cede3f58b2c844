"""iso-bench on tiny_dense: every iso row shows max |dlogp| exactly 0 (sampled tokens and the full
vocabulary); native rows show their measured non-zero mismatch. Runs the Hydra app end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_iso.bench.grid import Layout, layouts
from megatron_iso.bench.report import markdown_table
from megatron_iso.testing.cli_process import run_python

REPO = Path(__file__).resolve().parents[2]


def test_iso_bench_default_grid(tmp_path):
    out = tmp_path / "bench.json"
    args = ["-m", "megatron_iso.cli.bench", "device=cpu", f"bench.out={out}", "bench.new_tokens=12"]
    proc = run_python(args, cwd=tmp_path, pythonpath=[REPO], timeout=600)  # forked: no 6-8 s of fresh imports
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    # profiles x {tp1, tp2, tp2+SP} x batch {1, 8}
    assert len(rows) == 2 * 3 * 2
    assert len({r["weights_sha256"] for r in rows}) == 1
    for b in (1, 8):
        assert len({json.dumps(r["prompts"]) for r in rows if r["batch"] == b}) == 1  # same prompts everywhere
    for r in rows:
        assert r["generated_tokens"] == 12 * r["batch"] == len(r["rollout_logprobs"]) == len(r["trainer_logprobs"])
        assert r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0
        if r["profile"] == "correctness":
            assert r["rollout_logprobs"] == r["trainer_logprobs"], r["layout"]
            assert r["dlogp_max"] == 0.0 and r["full_vocab_dlogp_max"] == 0.0, r["layout"]
            assert r["bitwise_equal_frac"] == 1.0
        else:
            # Native decode (M=1 GEMMs, cached attention) vs the training forward: the last bits move.
            assert r["full_vocab_dlogp_max"] > 0.0, r["layout"]
            assert r["dlogp_max"] > 0.0 or r["batch"] == 1, r["layout"]
    assert all(r["dlogp_max"] > 0 for r in rows if r["profile"] == "performance" and r["batch"] == 8)
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "| correctness | 2 | 1 | on | 1 | 8 |" in proc.stdout  # the markdown table on the console (CP 1)
    print(doc["table"] if "table" in doc else proc.stdout[-3000:])


def test_layouts_skip_sp_without_tp_and_validate():
    lays, notes = layouts(["correctness"], [1, 2], [1], [False, True])
    assert lays == [
        Layout("correctness", 1, 1, False),
        Layout("correctness", 2, 1, False),
        Layout("correctness", 2, 1, True),
    ]
    assert notes == ["skipped correctness/tp1/ep1/sp1: sequence parallelism needs tp > 1"]
    with pytest.raises(ValueError, match=r"bench.profiles=\['fast'\] is invalid"):
        layouts(["fast"], [1], [1], [False])
    with pytest.raises(ValueError, match=r"bench.tp=\[0\] is invalid"):
        layouts(["correctness"], [0], [1], [False])


def test_trainer_side_packs_ids_checked_against_the_vocab(monkeypatch):
    """The grid's teacher-forced scoring checks the target ids once, on the host, where it packs them (so the
    scoring reads none back per LM-head chunk); a bad id is named there."""
    from types import SimpleNamespace

    from megatron_iso.bench import grid
    from megatron_iso.models import scoring

    seen = []

    def score(model, ids, batch, **kwargs):
        seen.append(batch.ids_checked_below)
        return torch.zeros(ids.numel()), None

    monkeypatch.setattr(scoring, "score_sequences", score)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=64, sequence_parallel=False))
    settings = grid.BenchSettings(full_vocab=False)
    grid._trainer(model, [[1, 2, 3], [63]], settings)
    assert seen == [64]
    with pytest.raises(ValueError, match=r"^pack: sequence 0 holds token id 64 at position 1"):
        grid._trainer(model, [[1, 64]], settings)


def test_markdown_table_prints_exact_zero_and_escapes_pipes():
    row = {"profile": "correctness", "tp": 1, "ep": 1, "sp": False, "batch": 1, "dlogp_max": 0.0, "tokens_per_s": 3.0}
    text = markdown_table([row, {**row, "profile": "performance", "dlogp_max": 4.76837158203125e-07}])
    assert "max \\|dlogp\\|" in text
    assert "| correctness | 1 | 1 | off | 1 | 0 | 3.0 |" in text
    assert "4.768e-07" in text


def test_bench_out_defaults_to_a_new_directory_under_runs(tmp_path):
    from megatron_iso.bench.run import bench_out
    from megatron_iso.settings.compose import load_config

    cfg = load_config(["device=cpu"], config_name="iso_bench")
    assert cfg.bench.out is None and cfg.out_dir is None
    first, second = bench_out(cfg, root=tmp_path), bench_out(cfg, root=tmp_path)
    assert first.name == second.name == "bench.json" and first.parent.parent == tmp_path
    assert re.fullmatch(r"bench-\d{8}-\d{6}-[0-9a-f]{6}", first.parent.name) and first != second
    assert bench_out(load_config(["out_dir=runs/x"], config_name="iso_bench")) == Path("runs/x/bench.json")
    assert bench_out(load_config(["bench.out=a/b.json"], config_name="iso_bench")) == Path("a/b.json")


def test_a_bare_iso_bench_writes_its_report_under_runs(tmp_path):
    grid = ["bench.profiles=[correctness]", "bench.tp=[1]", "bench.sp=[false]", "bench.batch=[1]"]
    args = ["-m", "megatron_iso.cli.bench", "device=cpu", *grid, "bench.new_tokens=2"]
    proc = run_python(args, cwd=tmp_path, pythonpath=[REPO], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing else (no None/) in the cwd
    assert sorted(p.name for p in run.iterdir()) == ["bench.json", "bench.png"]
    assert f"bench.out=runs/{run.name}/bench.json" in proc.stderr
    assert json.loads((run / "bench.json").read_text())["bench"]["out"] == f"runs/{run.name}/bench.json"
