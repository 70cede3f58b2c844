"""The example launch scripts (examples/*.sh) refuse, in one line with exit 2, what would otherwise surface as
torchrun's ChildFailedError from every rank: no torchrun to run (no active virtualenv, no checkout .venv) and a
recipe path that does not exist."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _copy_examples(tmp_path: Path) -> Path:
    dst = tmp_path / "checkout" / "examples"
    shutil.copytree(EXAMPLES, dst)  # no .venv beside this copy
    return dst


def _run(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def test_no_torchrun_is_one_line_naming_what_to_activate(tmp_path):
    ex = _copy_examples(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    res = _run(ex / "torchrun_single_node.sh", env)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun not found" in lines[0] and "make venv" in lines[0], res.stderr


def test_a_missing_model_dir_is_refused_before_launch(tmp_path):
    ex = _copy_examples(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text("#!/bin/sh\necho launched\n")
    fake.chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "MODEL_DIR": "/nope", "DATA_DIR": str(data)}
    res = _run(ex / "grpo_gsm8k_qwen3_0p6b.sh", env)
    assert res.returncode == 2 and "launched" not in res.stdout, res.stdout + res.stderr
    assert res.stderr.strip() == "error: MODEL_DIR=/nope: no such dir"


def test_the_checkout_venv_is_found_without_activation(tmp_path):
    ex = _copy_examples(tmp_path)
    venv_bin = ex.parent / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake = venv_bin / "torchrun"
    fake.write_text('#!/bin/sh\necho "launched $*"\n')
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NPROC_PER_NODE": "2"}
    res = _run(ex / "torchrun_single_node.sh", env | {k: v for k, v in os.environ.items() if k == "LANG"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("launched --standalone --nnodes 1 --nproc-per-node 2 -m megatron_iso.cli.train")
