"""Prompt datasets on disk (``task=dataset``): jsonl or parquet files read with the ``datasets`` library.

A row's prompt (``data.prompt_key``) becomes token ids once, at start: a text prompt through ``task.template``
and then the tokenizer's chat template (``data.chat_template``: by default when the tokenizer has one, as a
user turn with the generation prompt appended); a prompt that already is a list of ``{role, content}`` messages
through the chat template only. Rows whose prompt is longer than ``rl.max_prompt_length`` tokens are dropped and
counted. The gold answer (``data.answer_key``, optionally cut out by ``data.answer_regex``) rides along in the
prompt's ``meta["answer"]`` for the reward; the whole row is in ``meta["row"]``.

Order: the training rows are visited epoch by epoch, each epoch in its own seeded permutation
(``data.shuffle``, ``data.seed``). Step ``s`` takes rows ``s * P .. s * P + P - 1`` of that endless sequence
(P = ``task.prompts_per_step``), so the position is a function of the step: a resumed run continues the epoch
where the interrupted one stopped, with nothing to save but the step. What keeps it exact is the data itself:
:meth:`DatasetTask.identity` (a digest of the token ids, answers and order settings) goes into the checkpoint,
and a resume over other data is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_iso.rl.tasks import (
    Prompt,
    RewardFn,
    Task,
    TaskError,
    Tasks,
    Tokenizer,
    check_prompts_fit,
    check_template,
    checked_tokenizer,
    make_task,
    resolve_reward,
    rollout_refusal,
    stop_token_ids,
)
from megatron_iso.settings import Settings
from megatron_iso.settings.data import DATA_FORMATS, DataSettings
from megatron_iso.settings.task import TaskSettings, resolve_task_path


def load_rows(files: Sequence[str], field_name: str) -> list[dict[str, Any]]:
    """Every row of ``files`` (one format), in file order, through ``datasets``; a file that is missing or that
    ``datasets`` cannot read is a :class:`TaskError` naming ``field_name``."""
    import datasets

    paths = [str(resolve_task_path(f, field_name.split(".", 1)[1], group=field_name.split(".", 1)[0])) for f in files]
    builder = DATA_FORMATS[Path(paths[0]).suffix.lower()]
    # Progress bars would print one line per file on every rank; the run prints its own summary.
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builder, data_files=paths, split="train")
    except Exception as exc:  # datasets wraps parse errors of either format in several types
        cause = exc.__cause__ or exc
        raise TaskError(f"{field_name}={list(files)!r}: datasets cannot read it ({type(cause).__name__}: "
                        f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''})") from exc  # fmt: skip
    if len(table) == 0:
        raise TaskError(f"{field_name}={list(files)!r} holds no rows")
    return table.to_list()


def _lookup(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, where ``a.b`` is field ``b`` of column ``a`` (nested structs, as in verl's parquet files)."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


class PromptEncoder:
    """A row's prompt cell -> token ids: ``task.template``, then the chat template when it is on."""

    def __init__(self, tokenizer: Tokenizer, data: DataSettings, template: str) -> None:
        self.tokenizer, self.template, self.data = tokenizer, check_template(template), data
        has = bool(getattr(tokenizer, "has_chat_template", False))
        if data.chat_template == "true" and not has:
            raise TaskError(
                "data.chat_template=true but the tokenizer (task.tokenizer) has no chat template; "
                "allowed values here: ['auto', 'false']"
            )
        self.chat = has and data.chat_template != "false"

    def __call__(self, cell: Any, where: str) -> list[int]:
        if _is_messages(cell):
            if not self.chat:
                raise TaskError(f"{where}: the prompt is a list of chat messages, which needs a chat template "
                                "(the tokenizer has none, or data.chat_template=false)")  # fmt: skip
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in cell]
        elif isinstance(cell, str):
            text = self.template.format(prompt=cell)
            if not self.chat:
                return self.tokenizer.encode(text)
            messages = [{"role": "user", "content": text}]
        else:
            raise TaskError(f"{where}: the prompt is a {type(cell).__name__}; allowed: a string or a list of "
                            "{role, content} messages")  # fmt: skip
        if self.data.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.data.system_prompt}, *messages]
        return self.tokenizer.chat_ids(messages, **self.data.chat_template_kwargs)


class DatasetTask(Task):
    """Prompt/answer rows from files (``data.train_files`` or ``data.val_files``), tokenized once at start."""

    def __init__(self, reward: RewardFn, tokenizer: Tokenizer, prompts_per_step: int, seed: int, *,
                 data: DataSettings, template: str, split: str = "train",
                 max_prompt_length: int | None = None) -> None:  # fmt: skip
        super().__init__(reward, tokenizer, prompts_per_step, seed if data.seed is None else data.seed)
        self.field = f"data.{split}_files"
        files = data.train_files if split == "train" else data.val_files
        if not files:
            raise TaskError(f"{self.field} is not set; task=dataset reads its prompts from it (a .jsonl or .parquet)")
        rows = load_rows(files, self.field)
        if split == "val" and data.val_max_samples is not None:
            rows = rows[: data.val_max_samples]
        encode = PromptEncoder(tokenizer, data, template)
        regex = None if data.answer_regex is None else re.compile(data.answer_regex)
        self.shuffle = data.shuffle and split == "train"
        self.ids: list[list[int]] = []
        self.meta: list[dict[str, Any]] = []
        self.row_index: list[int] = []  # each kept row's index in the files
        self.filtered = 0
        for i, row in enumerate(rows):
            where = f"{self.field} row {i}"
            cell, answer = (
                _field(row, data.prompt_key, "data.prompt_key", where),
                _field(row, data.answer_key, "data.answer_key", where),
            )
            ids = encode(cell, where)
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                self.filtered += 1
                continue
            self.ids.append(ids)
            self.meta.append({"answer": _gold(answer, regex, where), "row": row})
            self.row_index.append(i)
        self.chat = encode.chat
        self.total_rows = len(rows)
        if not self.ids:
            raise TaskError(
                f"{self.field}: all {len(rows)} prompts are longer than rl.max_prompt_length={max_prompt_length} "
                "tokens; raise rl.max_prompt_length"
            )
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def summary(self) -> dict[str, Any]:
        """What the run reports about its data once (stderr at start, the run summary)."""
        split = self.field.removeprefix("data.").removesuffix("_files")
        return {
            f"data/{split}_rows": len(self.ids),
            f"data/{split}_filtered_prompts": self.filtered,
            f"data/{split}_chat_template": self.chat,
        }

    def identity(self) -> dict[str, str]:
        """A digest of what fixes the prompt sequence (token ids, answers, order settings): a checkpoint records
        it, and a run resuming over other data, or in another order, is refused."""
        h = hashlib.sha256()
        h.update(json.dumps([self.shuffle, self.seed, self.prompts_per_step]).encode())
        for ids, meta in zip(self.ids, self.meta, strict=True):
            h.update(json.dumps([ids, str(meta["answer"])]).encode())
        return {f"{self.field.replace('.', '_')}_sha256": h.hexdigest()}

    def order(self, epoch: int) -> list[int]:
        """The rows of ``epoch`` in visiting order (a seeded permutation per epoch, or file order)."""
        if epoch not in self._orders:
            n = len(self.ids)
            if self.shuffle:
                self._orders = {epoch: torch.randperm(n, generator=self._generator(epoch)).tolist()}
            else:
                self._orders = {epoch: list(range(n))}
        return self._orders[epoch]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, index within it) of the first row step ``step`` takes."""
        return divmod(step * self.prompts_per_step, len(self.ids))

    def epoch_progress(self, step: int) -> float:
        """Epochs consumed before step ``step`` (fractional)."""
        return step * self.prompts_per_step / len(self.ids)

    def prompts(self, step: int) -> list[Prompt]:
        n, first = len(self.ids), step * self.prompts_per_step
        picks = []
        for g in range(first, first + self.prompts_per_step):
            epoch, i = divmod(g, n)
            picks.append(self.order(epoch)[i])
        return [self._prompt(i) for i in picks]

    def all_prompts(self) -> list[Prompt]:
        """Every kept row once, in file order (the validation set)."""
        return [self._prompt(i) for i in range(len(self.ids))]

    def _prompt(self, i: int) -> Prompt:
        return Prompt(ids=list(self.ids[i]), meta=self.meta[i])

    def prompt_lengths(self) -> Iterator[tuple[str, int]]:
        for i, ids in enumerate(self.ids):
            yield f"{self.field} row {self.row_index[i]}", len(ids)


def _field(row: dict[str, Any], key: str, setting: str, where: str) -> Any:
    try:
        return _lookup(row, key)
    except KeyError as exc:
        raise TaskError(
            f"{setting}={key!r}: {where} has no field {exc.args[0]!r}; its columns: {sorted(row)}"
        ) from None


def _gold(answer: Any, regex: re.Pattern[str] | None, where: str) -> str:
    text = str(answer)
    if regex is None:
        return text
    found = regex.findall(text)
    if not found:
        raise TaskError(f"data.answer_regex={regex.pattern!r} does not match the answer of {where}: {text[-80:]!r}")
    last = found[-1]
    return str(last[0] if isinstance(last, tuple) else last)


def report(task: DatasetTask, max_prompt_length: int | None, rank: int) -> None:
    """One line on stderr (rank 0): rows kept, prompts dropped by length, chat template on or off."""
    if rank != 0:
        return
    dropped = ""
    if max_prompt_length is not None:
        dropped = f", {task.filtered} dropped as longer than rl.max_prompt_length={max_prompt_length}"
    print(f"{task.field}: {len(task)} of {task.total_rows} prompts{dropped}; chat template "
          f"{'on' if task.chat else 'off'}", file=sys.stderr)  # fmt: skip


# --- the run's tasks -------------------------------------------------------------------------------------------


def _tokenizer_spec(task: TaskSettings, init_from: str | None) -> tuple[str, str]:
    """``task.tokenizer``, or for null the checkpoint the model starts from (``model.init_from``), else bytes; and
    how to name it in an error."""
    if task.tokenizer is not None:
        return task.tokenizer, f"task.tokenizer={task.tokenizer!r}"
    if init_from:
        return init_from, f"task.tokenizer=null (the checkpoint's: model.init_from={init_from!r})"
    return "bytes", "task.tokenizer=null (bytes: no model.init_from)"


def build_tasks(settings: Settings, vocab_size: int, engine: Any, rank: int = 0) -> Tasks:
    """The run's :class:`Tasks` from its ``settings``, every prompt checked against ``engine``'s limits
    (:func:`check_prompts_fit`) before the first step."""
    rl, data, seed = settings.require("rl"), settings.data, settings.require("seed")
    task: TaskSettings = settings.require("task")
    kind = task.name
    if kind != "dataset" and data.train_files:
        raise TaskError(f"data.train_files is set but task.name={kind!r} makes its own prompts; use task=dataset "
                        "(or task=gsm8k) to train on the files")  # fmt: skip
    if rl.val_every and (kind != "dataset" or not data.val_files):
        raise TaskError(f"rl.val_every={rl.val_every} needs data.val_files and task=dataset (task.name={kind!r}, "
                        f"data.val_files={list(data.val_files) or None}); rl.val_every=0 turns validation off")  # fmt: skip
    spec, named = _tokenizer_spec(task, settings.model.init_from)
    try:
        tokenizer = checked_tokenizer(spec, vocab_size)
    except TaskError as exc:
        raise TaskError(f"{named}: {exc}") from None
    common = {"data": data, "template": task.template, "max_prompt_length": rl.max_prompt_length}
    if kind != "dataset":
        # The task group as configured: each task builder reads its own keys (modulus, path, ...).
        train: Task = make_task(settings.config["task"], vocab_size, seed, tokenizer)
    else:
        train = DatasetTask(resolve_reward(task.reward), tokenizer, task.prompts_per_step, seed, **common)
        report(train, rl.max_prompt_length, rank)
    val = None
    if rl.val_every:
        val = DatasetTask(train.reward_fn, tokenizer, 1, seed, split="val", **common)
        report(val, rl.max_prompt_length, rank)
    refusal = rollout_refusal(engine, rl.max_response_length, rl.group_size)
    limit = rl.max_prompt_length
    check_prompts_fit(
        train, lambda n: f"longer than rl.max_prompt_length={limit}" if limit and n > limit else refusal(n)
    )
    if val is not None:
        check_prompts_fit(val, rollout_refusal(engine, rl.max_response_length, rl.val_n))
    stop = stop_token_ids(rl.stop_token_ids, tokenizer)
    bad = [t for t in stop if t >= vocab_size]
    if bad:
        raise TaskError(f"rl.stop_token_ids: {bad} not below the model's vocab size {vocab_size} (from "
                        f"{'the setting' if rl.stop_token_ids is not None else named})")  # fmt: skip
    return Tasks(train=train, val=val, stop_ids=stop)
