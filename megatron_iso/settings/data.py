"""The ``data`` group (prompt datasets on disk) and the ``rl`` fields of generation and validation, typed and checked.

``data``: the files a ``task=dataset`` run reads (jsonl or parquet, through the ``datasets`` library), which columns
hold the prompt and the gold answer, how the prompt becomes tokens (the tokenizer's chat template) and the order
rows are visited in. The ``rl`` fields checked here (:func:`check_generation`) say how the rollout samples and
stops (``top_p``, ``top_k``, ``stop_token_ids``, ``max_prompt_length``, ``max_response_length``) and when the
validation pass runs (``val_every``, ``val_before_train``, ``val_temperature``, ``val_n``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_iso.settings.fields import SettingsError, _bool, _choice, _get, _int, check_temperature

DATA_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # suffix -> datasets builder
CHAT_TEMPLATE_MODES = ("auto", "true", "false")  # auto: on when the tokenizer has a template


@dataclass(frozen=True)
class DataSettings:
    """``data`` (conf/data/*.yaml), typed."""

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    answer_regex: str | None = None  # the gold answer is the regex's first group in the answer cell (last match)
    chat_template: str = "auto"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    shuffle: bool = True
    seed: int | None = None  # None: the run's seed
    val_max_samples: int | None = None  # None: every validation row


def _files(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(v, str) and v.strip() for v in items):
        raise SettingsError(
            f"{name}={value!r} is not allowed; allowed values: a path or a list of paths to .jsonl or .parquet files"
        )
    for item in items:
        if Path(item).suffix.lower() not in DATA_FORMATS:
            raise SettingsError(
                f"{name}: {item!r} is not allowed; allowed values: files ending in {sorted(DATA_FORMATS)}"
            )
    if len({Path(i).suffix.lower() in (".jsonl", ".json") for i in items}) > 1:
        raise SettingsError(f"{name}={list(items)!r} mixes jsonl and parquet files; give files of one format")
    return tuple(str(i) for i in items)


def _key(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SettingsError(f"{name}={value!r} is not allowed; allowed values: a column name (a.b for a nested field)")
    return value


def resolve_data(data: Mapping[str, Any] | None) -> DataSettings:
    """``data`` typed; a missing group is the defaults (no files)."""
    data = data or {}
    regex = _get(data, "answer_regex")
    if regex is not None:
        try:
            groups = re.compile(str(regex)).groups
        except re.error as exc:
            raise SettingsError(f"data.answer_regex={regex!r} is not a regular expression ({exc})") from None
        if groups < 1:
            raise SettingsError(f"data.answer_regex={regex!r} needs a group, e.g. '#### (.+)': the answer is group 1")
    mode = _get(data, "chat_template", "auto")
    mode = str(mode).lower() if isinstance(mode, bool) else mode
    kwargs = _get(data, "chat_template_kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise SettingsError(f"data.chat_template_kwargs={kwargs!r} is not allowed; allowed values: a mapping")
    system = _get(data, "system_prompt")
    seed = _get(data, "seed")
    val_max = _get(data, "val_max_samples")
    return DataSettings(
        train_files=_files(_get(data, "train_files"), "data.train_files"),
        val_files=_files(_get(data, "val_files"), "data.val_files"),
        prompt_key=_key(_get(data, "prompt_key", "prompt"), "data.prompt_key"),
        answer_key=_key(_get(data, "answer_key", "answer"), "data.answer_key"),
        answer_regex=None if regex is None else str(regex),
        chat_template=_choice(mode, "data.chat_template", CHAT_TEMPLATE_MODES),
        chat_template_kwargs=dict(kwargs),
        system_prompt=None if system is None else str(system),
        shuffle=_bool(_get(data, "shuffle", True), "data.shuffle"),
        seed=None if seed is None else _int(seed, "data.seed", 0),
        val_max_samples=None if val_max is None else _int(val_max, "data.val_max_samples", 1),
    )


# --- rl: generation and validation ---------------------------------------------------------------------------------


def _stop_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    ok = isinstance(value, Sequence) and not isinstance(value, str)
    ok = ok and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    if not ok:
        raise SettingsError(
            f"rl.stop_token_ids={value!r} is not allowed; allowed values: null (the tokenizer's EOS and its "
            "generation_config.json's eos_token_id), [] (none) or a list of token ids >= 0"
        )
    return tuple(value)


def response_length(rl: Mapping[str, Any]) -> int:
    """``rl.max_response_length``; ``rl.max_new_tokens``, its former name, still sets it (with a warning)."""
    old = rl.get("max_new_tokens")
    if old is not None:
        warnings.warn(
            "rl.max_new_tokens is deprecated and will be removed; it is now rl.max_response_length (the same "
            f"value, the most tokens a response may have): rl.max_new_tokens={old!r} sets it",
            FutureWarning,
            stacklevel=2,
        )
        return _int(old, "rl.max_new_tokens", 1)
    return _int(_get(rl, "max_response_length", 8), "rl.max_response_length", 1)


def check_generation(rl: Mapping[str, Any]) -> dict[str, Any]:
    """The ``rl`` fields of sampling, stopping and validation, checked; keyword arguments of ``RLSettings``."""
    max_prompt = _get(rl, "max_prompt_length")
    top_p = _get(rl, "top_p", 1.0)
    ok = isinstance(top_p, int | float) and not isinstance(top_p, bool) and 0 < top_p <= 1
    if not ok:
        raise SettingsError(f"rl.top_p={top_p!r} is not allowed; allowed values: numbers in (0, 1] (1 = off)")
    val_t = _get(rl, "val_temperature", 0.0)
    length = response_length(rl)
    return {
        "max_prompt_length": None if max_prompt is None else _int(max_prompt, "rl.max_prompt_length", 1),
        "max_response_length": length,
        "max_new_tokens": length,
        "top_p": float(top_p),
        "top_k": _int(_get(rl, "top_k", 0), "rl.top_k", 0),
        "stop_token_ids": _stop_ids(rl.get("stop_token_ids")),
        "val_every": _int(_get(rl, "val_every", 0), "rl.val_every", 0),
        "val_before_train": _bool(_get(rl, "val_before_train", True), "rl.val_before_train"),
        "val_temperature": check_temperature(val_t, "rl.val_temperature", zero=True),
        "val_n": _int(_get(rl, "val_n", 1), "rl.val_n", 1),
        "log_entropy": _bool(_get(rl, "log_entropy", True), "rl.log_entropy"),
    }
