"""iso-train against bad input, as a user meets it: the exit code, one line naming the problem, no
traceback, and nothing written (every case checks that its out_dir was not created).

Each command line runs as its own process, forked from the test harness's fork server with torch and Megatron
already imported (``megatron_iso.testing.cli_process``): a fresh interpreter per case spent 6-8 s importing them,
about 5 minutes over this file. The console entry point itself runs as a real ``python -m`` process in
:func:`test_the_entry_point_refuses_a_bad_setting_in_one_line` and the NaN stop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_iso.testing.cli_process import run_python

REPO = Path(__file__).resolve().parents[2]
FAST = ["rl.group_size=2", "rl.max_response_length=2", "task.prompts_per_step=2", "logger=none"]

BAD_SETTINGS = [
    ("rl.steps=abc", r"rl\.steps='abc' is not allowed; allowed values: integers >= 1"),
    ("rl.steps=0", r"rl\.steps=0 is not allowed"),
    ("rl.group_size=0", r"rl\.group_size=0 is not allowed; allowed values: integers >= 2"),
    ("rl.group_size=1", r"rl\.group_size=1 is not allowed"),
    ("rl.max_new_tokens=0", r"rl\.max_new_tokens=0 is not allowed"),
    ("rl.lr=-1", r"rl\.lr=-1 is not allowed; allowed values: finite numbers > 0"),
    ("rl.temperature=0", r"rl\.temperature=0 is not allowed"),
    ("rl.checkpoint_every=0", r"rl\.checkpoint_every=0 is not allowed"),
    (
        "rl.lr_decay_style=step",
        r"rl\.lr_decay_style='step' is not allowed; allowed values: \['constant', 'linear', 'cosine'\]",
    ),
    ("rl.lr_warmup_steps=20", r"rl\.lr_warmup_steps=20 is not allowed; allowed values: 0 \.\. 19"),
    ("rl.min_lr=1", r"rl\.min_lr=1 is not allowed; allowed values: 0 \.\. rl\.lr = 0\.02"),
    ("rl.weight_decay=-1", r"rl\.weight_decay=-1 is not allowed; allowed values: finite numbers >= 0"),
    ("rl.nonfinite=ignore", r"rl\.nonfinite='ignore' is not allowed; allowed values: \['stop', 'skip'\]"),
    ("parallel.tp=0", r"parallel\.tp=0 is not allowed; allowed values: integers >= 1"),
    ("parallel.tp=-4", r"parallel\.tp=-4 is not allowed"),
    ("parallel.tp=3", r"parallel\.tp=3 does not divide model\.num_attention_heads=8.*allowed values: \[1, 2, 4\]"),
    # Model fields and layouts Megatron cannot shard are usage errors (exit 2), refused before any world opens.
    ("model.params_dtype=fp16", r"model\.params_dtype='fp16' is not allowed; allowed values: \['bf16', 'fp32'\]"),
    (
        "profile=performance parallel.tp=2 model.vocab_size=255",
        r"parallel\.tp=2 does not divide model\.vocab_size=255: Megatron cannot shard .*allowed values: \[1\]",
    ),
    (
        "parallel.tp=2",
        r"parallel\.tp=2 needs 2 processes, and this is a single process \(not started by torchrun\); launch it with "
        r"torchrun, e\.g\. `torchrun --nproc-per-node 2 -m megatron_iso\.cli\.train parallel\.tp=2 \.\.\.`",
    ),
    ("parallel.pp=2", r"parallel\.pp=2 needs 2 processes, and this is a single process \(not started by torchrun\)"),
    ("parallel.pp=2 model.tie_word_embeddings=true", r"parallel\.pp=2 needs model\.tie_word_embeddings=false"),
    ("parallel.cp=3", r"parallel\.cp=3 is not allowed; allowed values: \[1, 2, 4, 8\]"),
    ("parallel.cp=2", r"parallel\.cp=2 needs 2 processes, and this is a single process \(not started by torchrun\)"),
    (
        "parallel.ep=2",
        r"parallel\.ep=2 does not apply to a dense model: it has no routed experts .*allowed values: \[1\]",
    ),
    ("resume=maybe", r"resume='maybe' is not allowed; allowed values: \['false', 'true', 'auto'\]"),
    ("resume=true", r"resume=true but out_dir=.* does not exist"),
    ("device=tpu", r"device='tpu' is not allowed; allowed values"),
    ("profile.leaves=3", r"profile\.leaves=3 must be a power of two"),
    ("model=nope", r"Could not find 'model/nope'"),
    ("rl.nosuchkey=1", r"unknown key rl\.nosuchkey=1; the known keys are those of conf/rl/\*\.yaml"),
    ("+rl.lrr=0.1", r"unknown key rl\.lrr=0\.1; did you mean rl\.lr\?"),
    ("dist_timeout_s=0", r"dist_timeout_s=0 is not allowed; allowed values: finite numbers > 0"),
    ("logger.name=tensorboard", r"logger\.name='tensorboard' is not allowed; allowed values: \['none', 'wandb'\]"),
    ("out_dir=", r"out_dir='' is not allowed; allowed values: a directory path, or null"),
    ("rollout.kv_cache_mb=0", r"rollout\.kv_cache_mb=0 is not allowed; allowed values: integers >= 1"),
    ("task.name=chess", r"task\.name='chess' is not allowed; allowed values: \['residue', 'jsonl', 'dataset'\]"),
    (
        "task=jsonl_math task.path=nope.jsonl",
        r"task\.path='nope\.jsonl': no such file \(.*/nope\.jsonl nor .*/nope\.jsonl\)",
    ),
    # Prompts the rollout would refuse, named before the first step: too long for the model, too big for the KV cache.
    (
        "task.prompt_len=600",
        r"task\.prompt_len=600: every prompt has 600 tokens: the model runs at most 512 tokens per sequence.*"
        r"model\.max_position_embeddings",
    ),
    (
        "task.prompt_len=200 rl.max_response_length=300 rl.group_size=8 rollout.kv_cache_mb=1",
        r"task\.prompt_len=200: every prompt has 200 tokens: its rl\.group_size=8 samples of up to 500 tokens need "
        r"173 KV-cache blocks, the rollout holds 64; raise rollout\.kv_cache_mb",
    ),
]


def _iso_train(*args: str, cwd: Path, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """iso-train with ``args`` in ``cwd``: forked (see the module doc), or in a fresh interpreter if ``fresh``."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if not fresh:
        return run_python(["-m", "megatron_iso.cli.train", *args], cwd=cwd, env=env, timeout=600)
    return subprocess.run(
        [sys.executable, "-m", "megatron_iso.cli.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("iso-train:")]


def _check_refused(tmp_path: Path, override: str, message: str, *, fresh: bool = False) -> None:
    run_dir = tmp_path / "run"
    proc = _iso_train(*FAST, f"out_dir={run_dir}", *override.split(), cwd=tmp_path, fresh=fresh)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and re.search(message, lines[0]), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(("override", "message"), BAD_SETTINGS, ids=[o for o, _ in BAD_SETTINGS])
def test_a_bad_setting_is_one_line_with_exit_2_and_writes_nothing(tmp_path, override, message):
    _check_refused(tmp_path, override, message)


def test_the_entry_point_refuses_a_bad_setting_in_one_line(tmp_path):
    # One case end to end through a fresh interpreter: `python -m`, its imports, its exit code and stderr.
    _check_refused(tmp_path, *BAD_SETTINGS[0], fresh=True)


def test_nan_stops_with_exit_3_and_leaves_no_nan_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, f"out_dir={run_dir}", "rl.steps=3", "rl.lr=1e30", "rl.checkpoint_every=1"]
    proc = _iso_train(*args, cwd=tmp_path, fresh=True)  # a whole run, end to end through a fresh interpreter
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "NaN or Inf" in _error_lines(proc.stderr)[0]
    from megatron_iso.checkpoint.run_ckpt import checkpoint_tensors

    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        assert all(bool(t.isfinite().all()) for t in checkpoint_tensors(ckpt, optimizer=True).values())


def test_a_second_bare_run_in_the_same_out_dir_is_refused_with_the_way_out(tmp_path):
    run_dir = tmp_path / "run"
    assert _iso_train(*FAST, f"out_dir={run_dir}", "rl.steps=1", cwd=tmp_path).returncode == 0
    before = (run_dir / "metrics.jsonl").read_text()
    proc = _iso_train(*FAST, f"out_dir={run_dir}", "rl.steps=1", cwd=tmp_path)
    assert proc.returncode == 2 and "resume=auto" in _error_lines(proc.stderr)[0]
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_bare_runs_in_one_directory_each_get_a_new_run_dir(tmp_path):
    procs = [_iso_train(*FAST, "rl.steps=1", cwd=tmp_path) for _ in range(2)]
    assert [p.returncode for p in procs] == [0, 0], procs[-1].stderr[-2000:]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and all((d / "metrics.jsonl").is_file() for d in dirs)
    printed = [re.search(r"^out_dir=(\S+) ", p.stderr, re.MULTILINE) for p in procs]
    assert sorted(tmp_path / m.group(1) for m in printed) == dirs
    assert [yaml.safe_load((d / "config.yaml").read_text())["out_dir"] for d in dirs] == [
        str(d.relative_to(tmp_path)) for d in dirs
    ]


def test_a_multirun_writes_only_under_runs(tmp_path):
    proc = _iso_train("-m", *FAST, "rl.steps=1", "seed=1,2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]  # no multirun/<date>/ of Hydra's in the cwd
    sweeps = sorted((tmp_path / "runs").glob("multirun-*"))
    assert len(sweeps) == 1 and [p.name for p in sweeps[0].iterdir()] == ["multirun.yaml"]
    runs = [d for d in (tmp_path / "runs").iterdir() if d not in sweeps]
    assert len(runs) == 2 and all((d / "metrics.jsonl").is_file() for d in runs)


@pytest.mark.parametrize("mode", ["true", "auto"])
def test_resume_without_an_out_dir_is_refused(tmp_path, mode):
    proc = _iso_train(*FAST, f"resume={mode}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and f"resume={mode} needs the out_dir of the run to continue" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_dataset_row_too_long_for_the_model_is_named_before_any_step(tmp_path):
    rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "9" * 600, "answer": "9"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = _iso_train(*FAST, "task=jsonl_math", "task.path=data.jsonl", f"out_dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc.stderr)
    want = (
        f"task.path row 1 ({tmp_path / 'data.jsonl'}:2, with task.template) has 607 tokens: the model runs at most 512"
    )
    assert len(lines) == 1 and want in lines[0], proc.stderr[-2000:]
    assert not run_dir.exists()
