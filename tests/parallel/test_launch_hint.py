"""A layout that needs torchrun, asked of a single process: the LaunchError's hint launches the program that is
running (iso-train, another console script, a tool's script), not always iso-train."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from megatron_iso.parallel.world import LaunchError, launched_world


@pytest.mark.parametrize(
    ("argv0", "main_module", "target"),
    [
        ("tools/bench_rl_step.py", None, "tools/bench_rl_step.py"),
        ("/venv/bin/iso-bench", None, "-m megatron_iso.cli.bench"),
        ("/venv/bin/iso-train", None, "-m megatron_iso.cli.train"),
        ("/repo/megatron_iso/cli/train.py", "megatron_iso.cli.train", "-m megatron_iso.cli.train"),  # python -m
        ("", None, "<your program>"),
    ],
)
def test_launch_hint_names_the_running_program(monkeypatch, argv0, main_module, target):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", [argv0, "parallel.tp=2"])
    spec = None if main_module is None else SimpleNamespace(name=main_module)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", spec, raising=False)
    hint = f"`torchrun --nproc-per-node 4 {target} parallel.tp=2 parallel.pp=2 ...`, or set parallel.tp=1 parallel.pp=1"
    with pytest.raises(LaunchError) as err, launched_world(tp=2, pp=2):
        pass
    assert str(err.value).startswith("parallel.tp=2, parallel.pp=2 need 4 processes, and this is a single process")
    assert str(err.value).endswith(hint)
