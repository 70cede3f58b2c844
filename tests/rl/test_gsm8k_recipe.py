"""examples/grpo_gsm8k_qwen3_0p6b.sh composes a valid config: every override names an existing setting."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from megatron_iso.settings import resolve
from megatron_iso.settings.compose import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_recipe_passes_settings_that_resolve(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    model, data = tmp_path / "m", tmp_path / "d"  # the recipe checks that its paths exist before launching
    model.mkdir()
    (model / "config.json").write_text("{}")
    data.mkdir()
    for name in ("train.parquet", "test.parquet"):
        (data / name).write_bytes(b"")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODEL_DIR": str(model), "DATA_DIR": str(data)}
    script = ROOT / "examples" / "grpo_gsm8k_qwen3_0p6b.sh"
    out = subprocess.run(["bash", str(script), "rl.steps=50"], env=env, capture_output=True, text=True, check=True)
    args = out.stdout.splitlines()
    overrides = args[args.index("megatron_iso.cli.train") + 1 :]
    assert f"model.init_from={model}" in overrides and overrides[-1] == "rl.steps=50"
    # The checkpoint directory is the other half of the recipe: resolve the rest without it.
    cfg = load_config([o for o in overrides if not o.startswith("model.init_from=")])
    settings = resolve(cfg)
    assert settings.data.train_files == (f"{data}/train.parquet",) and settings.data.prompt_key == "question"
    assert settings.data.chat_template_kwargs == {"enable_thinking": False}
    assert (settings.rl.max_response_length, settings.rl.val_every, settings.rl.steps) == (1024, 25, 50)
    assert cfg.task.name == "dataset" and cfg.task.reward == "math_verify"
    missing = subprocess.run(["bash", str(script)], env={**env, "MODEL_DIR": ""}, capture_output=True, text=True)
    assert missing.returncode != 0 and "set MODEL_DIR" in missing.stderr
