"""iso-train on files: a GSM8K-shaped parquet with a key mapping and a chat-template tokenizer trains, validates,
resumes at the same data position, and stops samples at stop tokens."""

from __future__ import annotations

import json

import pytest

from megatron_iso.rl.checkpoint import CheckpointError
from megatron_iso.rl.run import TIMING_PREFIXES, train
from megatron_iso.settings.compose import load_config
from tests.rl.data_cases import chat_tokenizer_dir, gsm8k_rows, write_parquet

FAST = ["rl.group_size=2", "rl.max_response_length=4", "task.prompts_per_step=2", "logger=none"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gsm8k")
    return {
        "train": write_parquet(root / "train.parquet", gsm8k_rows(5)),
        "val": write_parquet(root / "test.parquet", gsm8k_rows(3)),
        "tok": chat_tokenizer_dir(root / "tok"),
    }


def _gsm8k(files, out, *overrides):
    args = ["task=gsm8k", "data=gsm8k", f"data.train_files={files['train']}", f"task.tokenizer={files['tok']}"]
    return train(load_config([*FAST, *args, f"out_dir={out}", *overrides]))


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _computed(row):
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def test_gsm8k_parquet_trains_and_validates(tmp_path, files):
    out = _gsm8k(files, tmp_path / "run", "rl.steps=2", "rl.val_every=1", f"data.val_files={files['val']}",
                 "rl.max_prompt_length=100", "rl.val_n=2", "rl.val_temperature=1.0")  # fmt: skip
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]  # two steps, then the final policy's validation
    for r in rows:
        assert r["val/prompts"] == 3.0 and 0.0 <= r["val/pass@1"] <= r["val/pass@2"] <= 1.0
        assert {"val/reward_mean", "val/response_length_mean", "val/truncated_frac", "timing/val_s"} <= set(r)
    assert "reward/mean" not in rows[2] and out["validation"]["val/prompts"] == 3.0
    for r in rows[:2]:
        assert r["mismatch/abs_diff_max"] == 0.0 and r["train/token_mult_prob_error"] == 1.0
        assert r["training/rollout_probs_diff_max"] == 0.0 and r["train/train_rollout_logprob_abs_diff"] == 0.0
        assert 1 <= r["response/length_mean"] <= r["response/length_max"] <= 4
        assert 0.0 <= r["response/truncated_frac"] <= 1.0 and r["policy/entropy"] > 0 and "optim/lr" in r
    assert [r["data/epoch"] for r in rows[:2]] == [0.0, 0.4]
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "meta.json").read_text())
    assert len(meta["data_train_files_sha256"]) == 64


def test_resume_continues_the_epoch_exactly_and_refuses_other_data(tmp_path, files):
    # 5 rows, 2 per step: step 2 crosses into the second epoch.
    _gsm8k(files, tmp_path / "full", "rl.steps=4")
    _gsm8k(files, tmp_path / "cut", "rl.steps=2")
    _gsm8k(files, tmp_path / "cut", "rl.steps=4", "resume=true")
    full, cut = _rows(tmp_path / "full"), _rows(tmp_path / "cut")
    assert [_computed(r) for r in full] == [_computed(r) for r in cut]
    other = write_parquet(tmp_path / "other.parquet", gsm8k_rows(6))
    with pytest.raises(CheckpointError, match=r"data_train_files_sha256="):
        _gsm8k(files, tmp_path / "cut", "rl.steps=5", "resume=true", f"data.train_files={other}")


def test_stop_tokens_end_samples(tmp_path):
    every = "[" + ",".join(str(t) for t in range(256)) + "]"
    train(load_config([*FAST, "rl.steps=1", "rl.max_response_length=6", f"rl.stop_token_ids={every}",
                       f"out_dir={tmp_path / 'stop'}"]))  # fmt: skip
    (row,) = _rows(tmp_path / "stop")
    assert row["response/length_max"] == 1.0 and row["response/truncated_frac"] == 0.0
    train(load_config([*FAST, "rl.steps=1", "rl.max_response_length=6", f"out_dir={tmp_path / 'free'}"]))
    (row,) = _rows(tmp_path / "free")
    assert row["response/length_max"] == 6.0 and row["response/truncated_frac"] == 1.0  # bytes: no stop token
