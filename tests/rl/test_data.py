"""Prompt datasets (task=dataset): files through `datasets`, key mapping, chat template, length filter, order and
resume position, stop tokens, the metric definitions, and settings errors that name their field."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from megatron_iso.rl.data import DatasetTask, _tokenizer_spec, build_tasks
from megatron_iso.rl.metrics import alias_metrics
from megatron_iso.rl.tasks import (
    ByteTokenizer,
    HFTokenizer,
    TaskError,
    resolve_reward,
    stop_token_ids,
)
from megatron_iso.rl.validation import due, val_metrics
from megatron_iso.settings import SettingsError, resolve
from megatron_iso.settings.compose import load_config
from megatron_iso.settings.data import DataSettings
from tests.rl.data_cases import chat_tokenizer_dir, gsm8k_rows, write_jsonl, write_parquet

GSM8K = {"prompt_key": "question", "answer_key": "answer", "answer_regex": r"####\s*(-?[0-9][0-9,]*)"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chat_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def _task(files, tokenizer, *, n=2, seed=0, split="train", max_prompt_length=None, template="{prompt}", **data):
    key = "val_files" if split == "val" else "train_files"
    settings = DataSettings(**{key: tuple(str(f) for f in files), **GSM8K, **data})
    return DatasetTask(resolve_reward("math_verify"), tokenizer, n, seed, data=settings, template=template,
                       split=split, max_prompt_length=max_prompt_length)  # fmt: skip


def test_gsm8k_parquet_maps_keys_applies_the_chat_template_and_cuts_the_answer(tmp_path, tok_dir):
    data = write_parquet(tmp_path / "train.parquet", gsm8k_rows(4))
    tok = HFTokenizer(str(tok_dir))
    task = _task([data], tok, template="Q: {prompt}")
    assert task.chat and len(task) == 4
    (first,) = [p for p in task.all_prompts()[:1]]
    text = tok._tok.decode(first.ids)
    assert text.startswith("<|im_start|> user\nQ: Tom has 0 apples") and text.endswith("<|im_start|> assistant\n")
    assert [p.meta["answer"] for p in task.all_prompts()] == ["2", "4", "6", "8"]
    assert task.reward(first, tok.encode("So the answer is 2.")) == 1.0
    assert task.reward(first, tok.encode("So the answer is 3.")) == 0.0
    # Off by setting: the template's text alone; a system prompt goes before the user turn.
    plain = _task([data], tok, template="Q: {prompt}", chat_template="false")
    assert not plain.chat and tok.decode(plain.all_prompts()[0].ids).startswith("Q: Tom has 0")
    system = _task([data], tok, system_prompt="Be brief.")
    assert tok._tok.decode(system.all_prompts()[0].ids).startswith("<|im_start|> system\nBe brief.<|im_end|>")
    with pytest.raises(TaskError, match=r"data.chat_template=true but the tokenizer .* has no chat template"):
        _task([data], ByteTokenizer(), chat_template="true")


def test_jsonl_files_chat_message_prompts_and_nested_keys(tmp_path, tok_dir):
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = HFTokenizer(str(tok_dir))
    task = _task([data], tok, prompt_key="prompt", answer_key="reward_model.ground_truth", answer_regex=None)
    assert task.all_prompts()[0].meta["answer"] == "2"
    assert tok._tok.decode(task.all_prompts()[0].ids).startswith("<|im_start|> user\n")
    with pytest.raises(TaskError, match=r"chat messages, which needs a chat template"):
        _task([data], ByteTokenizer(), prompt_key="prompt", answer_key="reward_model.ground_truth", answer_regex=None)


def test_prompt_length_filter_drops_and_counts(tmp_path):
    rows = [{"question": "x" * k, "answer": "#### 1"} for k in (5, 50, 8, 70, 10)]
    data = write_parquet(tmp_path / "d.parquet", rows)
    task = _task([data], ByteTokenizer(), max_prompt_length=20)
    assert (len(task), task.filtered, task.total_rows) == (3, 2, 5)
    assert task.row_index == [0, 2, 4] and max(len(p.ids) for p in task.all_prompts()) <= 20
    assert task.summary() == {"data/train_rows": 3, "data/train_filtered_prompts": 2, "data/train_chat_template": False}
    with pytest.raises(TaskError, match=r"all 5 prompts are longer than rl.max_prompt_length=4"):
        _task([data], ByteTokenizer(), max_prompt_length=4)


def test_shuffled_epochs_visit_every_row_once_and_a_new_task_continues_the_position(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)]
    data = write_parquet(tmp_path / "d.parquet", rows)
    task = _task([data], ByteTokenizer(), n=2, seed=3)
    seq = [p.meta["answer"] for s in range(10) for p in task.prompts(s)]  # 20 rows: 4 epochs of 5
    epochs = [seq[i : i + 5] for i in range(0, 20, 5)]
    assert all(sorted(e) == ["0", "1", "2", "3", "4"] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # each epoch its own permutation
    assert task.position(3) == (1, 1) and task.epoch_progress(3) == 1.2
    # A resumed run builds the task anew: step 3 onward is the same rows (the epoch continues mid-way).
    again = _task([data], ByteTokenizer(), n=2, seed=3)
    assert [p.meta["answer"] for s in range(3, 10) for p in again.prompts(s)] == seq[6:]
    assert again.identity() == task.identity()
    assert _task([data], ByteTokenizer(), n=2, seed=4).identity() != task.identity()
    ordered = _task([data], ByteTokenizer(), n=2, shuffle=False)
    assert [p.meta["answer"] for s in range(5) for p in ordered.prompts(s)] == ["0", "1", "2", "3", "4"] * 2
    val = _task([data], ByteTokenizer(), split="val", val_max_samples=3)
    assert [p.meta["answer"] for p in val.all_prompts()] == ["0", "1", "2"]


def test_stop_tokens_come_from_the_tokenizer_and_generation_config_or_the_setting(tmp_path, tok_dir):
    tok = HFTokenizer(str(tok_dir))
    ids = tok._tok.convert_tokens_to_ids
    assert stop_token_ids(None, tok) == tuple(sorted({ids("<|im_end|>"), ids("<|endoftext|>")}))
    bare = HFTokenizer(str(chat_tokenizer_dir(tmp_path / "bare", generation_config=False)))
    assert stop_token_ids(None, bare) == (ids("<|im_end|>"),)
    assert stop_token_ids([7, 9], tok) == (7, 9) and stop_token_ids([], tok) == ()
    assert stop_token_ids(None, ByteTokenizer()) == ()


def test_alias_metrics_follow_the_other_frameworks_definitions():
    rollout = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float32)
    trainer = torch.tensor([-1.0, -2.5, -0.25], dtype=torch.float32)
    m = alias_metrics(rollout, trainer, torch.tensor([1, 2]))
    gap = [0.0, 0.5, 0.25]
    probs = [abs(torch.tensor(t).double().exp() - torch.tensor(r).double().exp()).item()
             for t, r in zip(trainer.tolist(), rollout.tolist(), strict=True)]  # fmt: skip
    assert m["training/rollout_probs_diff_max"] == pytest.approx(max(probs), rel=1e-12)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(sum(probs) / 3, rel=1e-12)
    assert m["train/token_mult_prob_error"] == pytest.approx(sum(torch.tensor(gap).double().exp().tolist()) / 3)
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx((0.0 + (0.5 + 0.25) / 2) / 2)  # per sample
    same = alias_metrics(rollout, rollout.clone(), torch.tensor([3]))
    assert same["train/token_mult_prob_error"] == 1.0 and same["training/rollout_probs_diff_max"] == 0.0


def test_validation_metrics_and_schedule():
    rows = [([1.0, 0.0], [3, 5], [False, True]), ([0.0, 0.0], [2, 2], [False, False])]
    m = val_metrics(rows, 2)
    assert m["val/reward_mean"] == 0.25 and m["val/pass@1"] == 0.25 and m["val/pass@2"] == 0.5
    assert m["val/response_length_mean"] == 3.0 and m["val/truncated_frac"] == 0.25 and m["val/prompts"] == 2.0
    rl = resolve(load_config(["rl.val_every=2", "rl.steps=5"])).rl
    assert [s for s in range(6) if due(rl, s, last=s == 5)] == [0, 2, 4, 5]
    rl = resolve(load_config(["rl.val_every=2", "rl.val_before_train=false"])).rl
    assert not due(rl, 0) and due(rl, 2)
    assert not due(resolve(load_config([])).rl, 0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_files=a.csv", r"data.train_files: 'a.csv' is not allowed; allowed values: files ending in"),
        ("data.chat_template=maybe", r"data.chat_template='maybe' is not allowed; allowed values: \['auto'"),
        ("data.answer_regex=abc", r"data.answer_regex='abc' needs a group"),
        ("data.prompt_key=''", r"data.prompt_key='' is not allowed"),
        ("data.val_max_samples=0", r"data.val_max_samples=0 is not allowed; allowed values: integers >= 1"),
        ("rl.top_p=0", r"rl.top_p=0 is not allowed; allowed values: numbers in \(0, 1\]"),
        ("rl.top_k=-1", r"rl.top_k=-1 is not allowed; allowed values: integers >= 0"),
        ("rl.stop_token_ids=[a]", r"rl.stop_token_ids=\['a'\] is not allowed; allowed values: null"),
        ("rl.max_prompt_length=0", r"rl.max_prompt_length=0 is not allowed"),
        ("rl.max_response_length=0", r"rl.max_response_length=0 is not allowed"),
        ("rl.val_every=-1", r"rl.val_every=-1 is not allowed"),
        ("rl.val_n=0", r"rl.val_n=0 is not allowed"),
        ("rl.val_temperature=-1", r"rl.val_temperature=-1 is not allowed"),
    ],
)
def test_settings_errors_name_the_field(override, message):
    with pytest.raises(SettingsError, match=message):
        resolve(load_config([override]))


def test_max_new_tokens_is_a_deprecated_name_of_max_response_length():
    with pytest.warns(FutureWarning, match=r"rl.max_new_tokens is deprecated.*rl.max_response_length"):
        rl = resolve(load_config(["rl.max_new_tokens=5"])).rl
    assert rl.max_response_length == rl.max_new_tokens == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(load_config(["rl.max_response_length=6"])).rl.max_new_tokens == 6


def test_task_and_data_groups_must_agree(tmp_path):
    data = str(write_parquet(tmp_path / "d.parquet", gsm8k_rows(2)))

    def build(*overrides):
        cfg = load_config(["seed=1", *overrides])
        return build_tasks(resolve(cfg), 256, engine=None)

    with pytest.raises(TaskError, match=r"data.train_files is set but task.name='residue' makes its own prompts"):
        build(f"data.train_files={data}")
    with pytest.raises(TaskError, match=r"rl.val_every=2 needs data.val_files and task=dataset"):
        build("task=dataset", "data=gsm8k", f"data.train_files={data}", "rl.val_every=2")
    with pytest.raises(TaskError, match=r"data.train_files is not set; task=dataset reads its prompts from it"):
        build("task=dataset")
    missing = re.escape("data.train_files='nope.parquet': no such file")
    with pytest.raises(TaskError, match=missing):
        build("task=dataset", "data.train_files=nope.parquet")
    with pytest.raises(TaskError, match=r"data.prompt_key='prompt': data.train_files row 0 has no field 'prompt'; "
                       r"its columns: \['answer', 'question'\]"):  # fmt: skip
        build("task=dataset", f"data.train_files={data}")
    # task.tokenizer null: the checkpoint's (model.init_from), else bytes.
    task = resolve(load_config(["task.tokenizer=null"])).task
    spec = _tokenizer_spec(task, "/m")
    assert spec == ("/m", "task.tokenizer=null (the checkpoint's: model.init_from='/m')")
    assert _tokenizer_spec(task, None)[0] == "bytes"


def test_a_reward_plug_in_sees_the_gold_answer_and_the_row(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt, response, tokenizer):\n"
        "    text = tokenizer.decode(response)\n"
        "    return float(text.strip() == prompt.meta['answer']) + 0.5 * ('apples' in prompt.meta['row']['question'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_parquet(tmp_path / "d.parquet", gsm8k_rows(2))
    settings = DataSettings(train_files=(str(data),), **GSM8K)
    task = DatasetTask(resolve_reward("my_reward:score"), ByteTokenizer(), 1, 0, data=settings, template="{prompt}")
    prompt = task.all_prompts()[1]
    assert task.reward(prompt, list(b"4")) == 1.5 and task.reward(prompt, list(b"5")) == 0.5
