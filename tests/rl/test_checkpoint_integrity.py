"""Run checkpoints that prove their integrity, end to end on a tiny CPU run: a garbled shard or an edited meta.json
of the latest checkpoint is refused on resume (exit 2) naming the file, its recorded and found SHA-256 and the
previous checkpoint, and the way out it offers works; resuming a finished run says so in one line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from megatron_iso.cli.exit_codes import EXIT_OK, EXIT_USAGE, run_cli
from megatron_iso.rl.checkpoint import CheckpointError
from megatron_iso.rl.run import train
from megatron_iso.settings.compose import load_config

FAST = ["rl.group_size=4", "rl.max_response_length=4", "task.prompts_per_step=3", "rl.checkpoint_every=1"]


def _cfg(run_dir, *overrides):
    return load_config([*FAST, f"out_dir={run_dir}", *overrides])


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _recorded(ckpt, name):
    return json.loads((ckpt / "checksums.json").read_text())["files"][name]["sha256"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished run of two steps, a checkpoint after each; tests work on copies."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    train(_cfg(run, "rl.steps=2"))
    return run


@pytest.fixture
def run(two_steps, tmp_path):
    return shutil.copytree(two_steps, tmp_path / "run")


def test_a_garbled_shard_is_refused_naming_it_and_the_way_back(run, capsys):
    latest = run / "checkpoints" / "step_000001"
    shard = sorted(latest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])  # same size, other bits
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert run_cli("iso-train", lambda: train(_cfg(run, "rl.steps=3", "resume=true"))) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{shard} is not the file saved: expected SHA-256 {_recorded(latest, shard.name)}" in err
    assert "found " in err and str(run / "checkpoints" / "step_000000") in err
    assert _steps(run) == [0, 1]  # nothing trained on, nothing logged
    # The way out the message gives, run as given: the next resume continues from the previous checkpoint.
    command = re.search(r"\((mv .*latest)\)", err).group(1)
    subprocess.run(command, shell=True, check=True)
    train(_cfg(run, "rl.steps=3", "resume=true"))
    assert _steps(run) == [0, 1, 2]


@pytest.mark.parametrize("steps", [3, 2])
def test_an_edited_step_in_meta_json_is_refused(run, steps):
    """Rewriting the step (to replay step 1) is caught whether the run has steps left or not: meta.json's digest is
    checked before its step is believed (whether the run is finished), before any world starts."""
    latest = run / "checkpoints" / "step_000001"
    meta = json.loads((latest / "meta.json").read_text())
    (latest / "meta.json").write_text(json.dumps({**meta, "step": 0}))
    with pytest.raises(CheckpointError, match=r"step_000001/meta\.json is not the file saved: expected SHA-256"):
        train(_cfg(run, f"rl.steps={steps}", "resume=true"))
    assert _steps(run) == [0, 1]


def test_resume_of_a_finished_run_says_so_with_its_last_metrics(run, capsys, monkeypatch):
    from megatron_iso.cli.train import _train

    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert _train(_cfg(run, "rl.steps=2", "resume=true")) == EXIT_OK
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == (
        f"iso-train: out_dir={run} already finished at step 1 (rl.steps=2): nothing to run; rl.steps counts every "
        "step of the run, so to train further raise it (e.g. rl.steps=4 resume=true)"
    )
    summary = json.loads(out.strip().splitlines()[-1])  # one JSON line on stdout
    assert summary["reward/mean"] == last["reward/mean"] and summary["step"] == 1
    assert None not in summary.values()
    assert sorted(p.name for p in run.iterdir()) == before  # no config.resumed_*.yaml, nothing written
    # Under torchrun only rank 0 prints the summary.
    monkeypatch.setenv("RANK", "1")
    assert _train(_cfg(run, "rl.steps=2", "resume=true")) == EXIT_OK
    assert capsys.readouterr() == ("", "")
