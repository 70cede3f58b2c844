"""tools/bench_rl_step.py from an HF directory (``model.init_from``), as the GPU proof of real checkpoints runs
it: a small transformers checkpoint's shapes and weights, both profiles, the iso profile's logprobs exact."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from tests.checkpoint.conftest import make_hf_model

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_rl_step.py"


def test_bench_runs_from_an_hf_directory(tmp_path):
    hf = make_hf_model(tmp_path / "hf", seed=5)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    spec = importlib.util.spec_from_file_location("bench_rl_step_init_from", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    out = tmp_path / "rl_step.json"
    argv = ["--model", "qwen3_0p6b", "--steps", "1", "--prompts", "2", "--group", "2", "--new-tokens", "4"]
    argv += ["--prompt-len", "4", "--kv-cache-mb", "16", "--out", str(out), f"model.init_from={hf}", "task.modulus=2"]
    assert tool.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == {}
    by = {r["profile"]: r for r in report["results"]}
    assert by["correctness"]["mismatch_max"] == 0.0 and by["correctness"]["bitwise_equal_frac"] == 1.0
    # The run took the checkpoint's model (64 wide), not the one --model names (Qwen3-0.6B, 1024 wide).
    args = argparse.Namespace(model="qwen3_0p6b", group=2, new_tokens=4, prompts=2, prompt_len=4, kv_cache_mb=16,
                              train_micro_batch_seqs=0, overrides=[f"model.init_from={hf}"])  # fmt: skip
    cfg = tool._config("correctness", args, str(tmp_path / "run"))
    assert (cfg.model.hidden_size, cfg.model.vocab_size, cfg.model.init_from) == (64, vocab, str(hf))
