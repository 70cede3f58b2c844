"""iso-bench's launchers: the torchrun launcher gives the gloo launcher's bits for the same grid
cell (CPU gloo ranks both), and ``--launcher`` takes only the names in ``LAUNCHERS``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_iso.bench.grid import LAUNCHERS, BenchSettings, Layout, layout_config, run_grid
from megatron_iso.cli.bench import BenchSettingsError, launcher_flag

REPO = Path(__file__).resolve().parents[2]
# Compared bit for bit (python floats hold the fp32 values exactly); the rest is timing or memory.
COMPUTED = ("weights_sha256", "prompts", "tokens", "rollout_logprobs", "trainer_logprobs", "dlogp_max")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU claim: the gloo launcher's forked ranks share one GPU")
def test_torchrun_launcher_gives_the_gloo_launchers_bits():
    # TP=2 with SP: the layout where reduction order across ranks matters most; native too, whose
    # non-zero mismatch must also be reproduced exactly (it depends only on the computation).
    lays = [Layout("correctness", 2, 1, True), Layout("performance", 2, 1, False)]
    settings = BenchSettings(config=layout_config(None, lays[0]), batches=(3,), new_tokens=4, kv_cache_mb=4)
    rows = {name: run_grid(lays, settings, launcher=name) for name in ("gloo", "torchrun")}
    assert len(rows["gloo"]) == len(rows["torchrun"]) == 2
    for g, t in zip(rows["gloo"], rows["torchrun"], strict=True):
        assert g["layout"] == t["layout"]
        for key in COMPUTED:
            assert g[key] == t[key], f"{g['layout']}: {key}"
    assert rows["gloo"][0]["dlogp_max"] == 0.0
    assert rows["gloo"][1]["full_vocab_dlogp_max"] > 0.0  # native: a real gap, reproduced above


def test_launcher_flag_becomes_the_override():
    assert sorted(LAUNCHERS) == ["gloo", "torchrun"]
    assert launcher_flag(["--launcher", "torchrun", "bench.tp=[2]"]) == ["bench.launcher=torchrun", "bench.tp=[2]"]
    assert launcher_flag(["model=tiny_moe", "--launcher=gloo"]) == ["model=tiny_moe", "bench.launcher=gloo"]
    assert launcher_flag(["bench.tp=[1]"]) == ["bench.tp=[1]"]
    with pytest.raises(
        BenchSettingsError, match=r"--launcher='nccl' is not allowed; allowed values: \['gloo', 'torchrun'\]"
    ):
        launcher_flag(["--launcher", "nccl"])
    with pytest.raises(BenchSettingsError, match="--launcher needs a value"):
        launcher_flag(["--launcher"])


def test_run_grid_refuses_an_unknown_launcher():
    with pytest.raises(
        ValueError, match=r"bench.launcher='mpi' is not allowed; allowed values: \['gloo', 'torchrun'\]"
    ):
        run_grid([Layout("correctness", 1, 1, False)], BenchSettings(), launcher="mpi")


def test_cli_refuses_a_bad_launcher_before_running(tmp_path):
    cmd = [sys.executable, "-m", "megatron_iso.cli.bench", "--launcher", "slurm", f"bench.out={tmp_path / 'b.json'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "iso-bench: error: --launcher='slurm' is not allowed; allowed values: ['gloo', 'torchrun']" in proc.stderr
    assert not (tmp_path / "b.json").exists()
