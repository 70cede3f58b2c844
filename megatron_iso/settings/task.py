"""The ``task`` group (where a step's prompts come from and how a response is graded), checked before any rank starts.

The task's builders (``megatron_iso.rl.tasks``, ``megatron_iso.rl.data``) own the list of tasks and rewards and
how a prompt file is found; this module asks them (lazily) and checks every value a run would otherwise meet as a
traceback in its first step: the name, the number of prompts, the residue task's sizes against the model, and a
prompt file that must be readable UTF-8 (:func:`check_task_files`, a check of this machine's files).
"""

from __future__ import annotations

import codecs
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_iso.settings.fields import SettingsError, _bool, _choice, _get, _int, _required


@dataclass(frozen=True)
class TaskSettings:
    """``task`` (conf/task/*.yaml), the fields every task has; the builders read the rest."""

    name: str
    prompts_per_step: int
    reward: str
    path: str | None = None  # task=jsonl_math: the prompt file
    prompt_len: int | None = None  # task=residue: tokens per prompt
    tokenizer: str | None = None  # None: the checkpoint's (model.init_from), else bytes
    template: str = "{prompt}"  # a prompt row's text around its {prompt}


class TaskError(SettingsError):
    """A task setting, or the data it names, that the run cannot use; the message names the ``task.<field>``."""


TASKS = ("residue", "jsonl", "dataset")  # task.name (rl.tasks builds them)
REWARD_NAMES = ("math_verify", "residue_match")  # task.reward's registered names (rl.tasks.REWARDS)


def import_callable(spec: str, field_name: str) -> Callable[..., Any]:
    """``package.module:function`` imported, as a run calls it; a UserError naming ``field_name`` otherwise."""
    if ":" not in spec:
        raise TaskError(
            f"{field_name}={spec!r} is not allowed; allowed values: {list(REWARD_NAMES)} or 'module:function'"
        )
    module, func = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), func, None)
    except ImportError as exc:
        raise TaskError(f"{field_name}={spec!r}: cannot import {module} ({exc})") from exc
    if not callable(fn):
        raise TaskError(f"{field_name}={spec!r}: {module} has no callable {func!r}")
    return fn


def _check_reward(reward: Any) -> str:
    """A reward the task builder can call: a registered name, or ``module:function`` importable (imported here,
    as the run would)."""
    if not isinstance(reward, str) or not reward.strip():
        raise TaskError(f"task.reward={reward!r} is not allowed; allowed values: a reward name or 'module:function'")
    if reward not in REWARD_NAMES:
        import_callable(reward, "task.reward")
    return reward


def resolve_task_path(value: str, field_name: str, *, directory: bool = False, group: str = "task") -> Path:
    """``<group>.<field_name>`` as an existing file (or ``directory``): an absolute path as it is; a relative one in
    the working directory, else in the config directory (where the shipped example data lives)."""
    from megatron_iso.settings.compose import conf_dir

    path = Path(value).expanduser()
    tried = [path] if path.is_absolute() else [Path.cwd() / path, conf_dir() / path]
    for candidate in tried:
        if candidate.is_dir() if directory else candidate.is_file():
            return candidate
    kind = "directory" if directory else "file"
    raise TaskError(f"{group}.{field_name}={value!r}: no such {kind} ({' nor '.join(str(t) for t in tried)})")


def resolve_task(task: Mapping[str, Any], vocab_size: int, max_positions: int) -> TaskSettings:
    """``task`` typed for a model of ``vocab_size`` tokens and ``max_positions`` positions: the name,
    ``prompts_per_step`` >= 1, a reward the builder finds, and the residue task's ``prompt_len`` (>= 1, leaving
    room for a response) and ``modulus`` in [2, vocab_size]."""
    name = _choice(_required(task, "name", "task"), "task.name", TASKS)
    n = _int(_required(task, "prompts_per_step", "task"), "task.prompts_per_step", 1)
    reward = _check_reward(_required(task, "reward", "task"))
    prompt_len = path = None
    if name == "residue":
        prompt_len = _int(_required(task, "prompt_len", "task"), "task.prompt_len", 1)
        if prompt_len >= max_positions:
            raise SettingsError(
                f"task.prompt_len={prompt_len}: every prompt has {prompt_len} tokens: the model runs at most "
                f"{max_positions} tokens per sequence, prompt and response (model.max_position_embeddings="
                f"{max_positions}); allowed values: 1 .. {max_positions - 1}"
            )
        modulus = _required(task, "modulus", "task")
        if isinstance(modulus, bool) or not isinstance(modulus, int) or not 2 <= modulus <= vocab_size:
            raise SettingsError(
                f"task.modulus={modulus!r} is not allowed; allowed values: integers from 2 to "
                f"model.vocab_size={vocab_size}"
            )
        _bool(_get(task, "conditional", False), "task.conditional")
    if name == "jsonl":
        path = _required(task, "path", "task")
        if not isinstance(path, str) or not path.strip():
            raise SettingsError(f"task.path={path!r} is not allowed; allowed values: the path of a .jsonl file")
    tokenizer = _get(task, "tokenizer")
    template = _get(task, "template", "{prompt}")
    if not isinstance(template, str):
        raise SettingsError(f"task.template={template!r} is not allowed; allowed values: a string holding {{prompt}}")
    return TaskSettings(
        name=name,
        prompts_per_step=n,
        reward=reward,
        path=path,
        prompt_len=prompt_len,
        tokenizer=None if tokenizer is None else str(tokenizer),
        template=template,
    )


def check_utf8(path: Path, field_name: str) -> None:
    """Refuse a text file that is not UTF-8, naming the field, the file, the line and the byte offset (read in
    blocks: a large file is never held whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    try:
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as exc:
                    at, bad_line = offset + exc.start, line + block[: exc.start].count(b"\n")
                    raise SettingsError(
                        f"{field_name}: {path}:{bad_line} is not UTF-8 (byte {at}: "
                        f"{block[exc.start : exc.start + 1]!r}); allowed values: UTF-8 text files"
                    ) from None
                line += block.count(b"\n")
                offset += len(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise SettingsError(
            f"{field_name}: {path} ends inside a UTF-8 character; allowed values: UTF-8 text files"
        ) from None
    except OSError as exc:
        raise SettingsError(f"{field_name}: {path} cannot be read ({exc.strerror or exc})") from None


def check_task_files(task: TaskSettings | None, train_files: Iterable[str] = (), val_files: Iterable[str] = ()) -> None:
    """The prompt files a run reads, on this machine: ``task.path`` (found as the task builder finds it) and the
    JSON lines files of ``data.train_files`` / ``data.val_files`` that exist, each readable UTF-8. (A file that
    does not exist is the builders' to name, with the places they looked.)"""
    if task is not None and task.path is not None:
        # No such file: a TaskError (a usage error) naming the places looked in, as the builder would.
        check_utf8(resolve_task_path(task.path, "path"), f"task.path={task.path!r}")
    for field_name, files in (("data.train_files", train_files), ("data.val_files", val_files)):
        for item in files:
            p = Path(item).expanduser()
            if p.suffix.lower() in (".jsonl", ".json") and p.is_file():
                check_utf8(p, field_name)
