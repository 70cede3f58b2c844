"""The hostile-input table (tests/cli/hostile_inputs.yaml) through each tool's pre-start entry point: every trial
gets its expected exit code, a refusal is one line holding the expected text, and nothing is a traceback.

In process and without building a model (``megatron_iso.cli.train.validate`` and its siblings:
tests/cli/hostile_table.py), so the whole table runs in about a minute on one CPU core."""

from __future__ import annotations

import pytest

from tests.cli.hostile_table import load_trials, make_files, run_trial

TRIALS = load_trials()


def test_the_table_is_large_and_covers_every_tool():
    assert len(TRIALS) >= 200
    assert {t["tool"] for t in TRIALS} == {"iso-train", "iso-bench", "iso-contract", "iso-bisect"}
    assert all(t["exit"] in (0, 2) and (t["exit"] == 0 or t["message"]) for t in TRIALS)


@pytest.fixture(scope="module")
def scratch_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    make_files(tmp)
    return tmp


@pytest.mark.parametrize("trial", TRIALS, ids=[f"{t['tool']} {t['args']}" for t in TRIALS])
def test_hostile_input(trial, scratch_dir, monkeypatch):
    monkeypatch.chdir(scratch_dir)  # relative paths and the default runs/ resolve in the scratch directory
    code, line, stderr = run_trial(trial, scratch_dir)
    assert "Traceback" not in stderr, stderr[-3000:]
    assert code == trial["exit"], f"exit {code}: {line or stderr[-2000:]}"
    if trial["exit"]:
        assert trial["message"] in line, line
