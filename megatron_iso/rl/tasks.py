"""Verifiable tasks: prompts, and rewards for the policy's responses.

A task yields prompts as token ids for a given step (deterministic in (seed, step), so a resumed
run sees the same prompts) and scores responses. Rewards are pluggable: ``task.reward`` names a
registered reward or a ``module:function`` path taking ``(prompt: Prompt, response: list[int],
tokenizer) -> float``.

File settings (``task.path``, a ``task.tokenizer`` directory) that are relative paths name a file in the
working directory or, when there is none there, in the config directory (``conf/``: the
shipped example data, e.g. ``task/arith.jsonl``), so the shipped tasks run from any directory. Every
prompt a task can yield is checked against the rollout's limits before the first step
(:func:`check_prompts_fit`). A setting or data file the task cannot use is a :class:`TaskError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_iso.settings.task import REWARD_NAMES, TASKS, TaskError, import_callable, resolve_task_path


def check_template(template: str) -> str:
    """``task.template`` must hold the field ``{prompt}`` and no other."""
    try:
        uses_prompt = template.format(prompt="a") != template.format(prompt="b")
    except (KeyError, IndexError, ValueError):
        uses_prompt = False
    if not uses_prompt:
        raise TaskError(f"task.template={template!r} must hold the field {{prompt}} and no other field")
    return template


# --- tokenizers ---------------------------------------------------------------------------


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256): lets a tiny model read and write text on a CPU."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's own tokenizer, from local files only (nothing fetched at run time), with its chat template and
    its stop tokens (EOS, and ``eos_token_id`` of a ``generation_config.json`` beside it)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        where = resolve_task_path(path, "tokenizer", directory=True)
        self.path = where
        try:
            self._tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TaskError(
                f"task.tokenizer={path!r}: {where} holds no tokenizer transformers can load ({exc})"
            ) from exc
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def chat_ids(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        """``messages`` through the chat template with the assistant's generation prompt appended, as token ids (the
        template writes its own special tokens, so none are added on encoding)."""
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.encode(text)

    def stop_ids(self) -> tuple[int, ...]:
        """EOS of the tokenizer and of ``generation_config.json`` (an id or a list: Qwen3 stops at <|im_end|> and
        <|endoftext|>), sorted."""
        ids = set() if self._tok.eos_token_id is None else {int(self._tok.eos_token_id)}
        if (self.path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(str(self.path), local_files_only=True).eos_token_id
            ids |= set() if eos is None else {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}
        return tuple(sorted(ids))


def make_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def stop_token_ids(setting: Sequence[int] | None, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The rollout's stop tokens: ``rl.stop_token_ids`` when set (``[]``: none), else the tokenizer's (none for
    bytes)."""
    if setting is not None:
        return tuple(int(t) for t in setting)
    stop = getattr(tokenizer, "stop_ids", None)
    return stop() if stop is not None else ()


# --- prompts and rewards ------------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[Prompt, list[int], Tokenizer], float]


def residue_match_reward(prompt: Prompt, response: list[int], tokenizer: Tokenizer) -> float:
    """Share of response tokens congruent to the prompt's key token modulo ``modulus``.

    A random policy scores 1/modulus on average, so the reward is dense from the first step and
    a tiny model learns the prompt-conditional rule in a few dozen steps.
    """
    if not response:
        return 0.0
    m, key = prompt.meta["modulus"], prompt.meta["key"]
    return sum(1 for t in response if t % m == key % m) / len(response)


def math_verify_reward(prompt: Prompt, response: list[int], tokenizer: Tokenizer) -> float:
    """1.0 if the decoded response contains an answer math-verify judges equal to the gold answer."""
    from math_verify import parse, verify

    gold = parse(str(prompt.meta["answer"]))
    pred = parse(tokenizer.decode(response))
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


REWARDS: dict[str, RewardFn] = {"residue_match": residue_match_reward, "math_verify": math_verify_reward}


if set(REWARDS) != set(REWARD_NAMES):  # the settings check the names this registry serves
    raise ImportError(f"rl.tasks.REWARDS {sorted(REWARDS)} != settings.task.REWARD_NAMES {sorted(REWARD_NAMES)}")


def resolve_reward(name: str) -> RewardFn:
    """A registered reward name or ``package.module:function``."""
    if name in REWARDS:
        return REWARDS[name]
    return import_callable(name, "task.reward")


class Task:
    """Prompts for a step and the reward of a response."""

    def __init__(self, reward: RewardFn, tokenizer: Tokenizer, prompts_per_step: int, seed: int) -> None:
        self.reward_fn = reward
        self.tokenizer = tokenizer
        self.prompts_per_step = prompts_per_step
        self.seed = seed

    # A step's extra generation batches (DAPO re-sampling, rl.max_gen_batches) read the prompt stream this far past
    # the step: a function of (step, draw) alone, so a resumed run draws the same prompts, and clear of the run's own
    # steps for any run shorter than 2**31 steps. Not a power of two: torch's CPU generator keeps only a seed's low
    # 32 bits, and the seeds derive from the step.
    RESAMPLE_STRIDE = 2**31 - 1

    def prompts(self, step: int) -> list[Prompt]:
        raise NotImplementedError

    def resample_prompts(self, step: int, draw: int) -> list[Prompt]:
        """The prompts of step ``step``'s generation batch ``draw`` (0: :meth:`prompts`, the step's own)."""
        return self.prompts(step + draw * self.RESAMPLE_STRIDE)

    def prompt_lengths(self) -> Iterator[tuple[str, int]]:
        """Every prompt this task can yield, as (where it comes from, for an error message; its token count)."""
        raise NotImplementedError

    def reward(self, prompt: Prompt, response: list[int]) -> float:
        return float(self.reward_fn(prompt, response, self.tokenizer))

    def _generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + step)


class ResidueTask(Task):
    """Synthetic: respond with tokens of one residue class modulo ``modulus``.

    ``conditional=False``: the class is 0 for every prompt (a tiny model from scratch learns it in
    about ten steps on a CPU). ``conditional=True``: the class is the prompt's last token's, so the
    policy must read the prompt (needs many more steps).
    """

    def __init__(self, reward: RewardFn, tokenizer: Tokenizer, prompts_per_step: int, seed: int, *, vocab_size: int,
                 prompt_len: int, modulus: int, conditional: bool) -> None:  # fmt: skip
        super().__init__(reward, tokenizer, prompts_per_step, seed)
        if modulus < 2 or modulus > vocab_size:
            raise TaskError(f"task.modulus={modulus} must be in [2, vocab_size={vocab_size}]")
        if prompt_len < 1:
            raise TaskError(f"task.prompt_len={prompt_len} is not allowed; allowed values: integers >= 1")
        self.vocab_size, self.prompt_len, self.modulus, self.conditional = vocab_size, prompt_len, modulus, conditional

    def prompts(self, step: int) -> list[Prompt]:
        g = self._generator(step)
        ids = torch.randint(0, self.vocab_size, (self.prompts_per_step, self.prompt_len), generator=g).tolist()
        return [
            Prompt(ids=row, meta={"key": row[-1] if self.conditional else 0, "modulus": self.modulus}) for row in ids
        ]

    def prompt_lengths(self) -> Iterator[tuple[str, int]]:
        yield f"task.prompt_len={self.prompt_len}: every prompt", self.prompt_len


class JsonlTask(Task):
    """Prompt/answer pairs from a JSONL file (keys ``prompt`` and ``answer``), cycled in a seeded order."""

    def __init__(self, reward: RewardFn, tokenizer: Tokenizer, prompts_per_step: int, seed: int, *, path: str,
                 template: str) -> None:  # fmt: skip
        super().__init__(reward, tokenizer, prompts_per_step, seed)
        self.file = resolve_task_path(path, "path")
        self.rows, self.lines = [], []  # the rows, and each one's line number in the file
        for n, line in enumerate(self.file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"task.path={path!r}: {self.file}:{n} is not JSON ({exc})") from None
            if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                got = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise TaskError(f"task.path={path!r}: {self.file}:{n} needs 'prompt' and 'answer' keys, got {got}")
            self.rows.append(row)
            self.lines.append(n)
        if not self.rows:
            raise TaskError(f"task.path={path!r}: {self.file} holds no rows")
        self.template = check_template(template)

    def _ids(self, i: int) -> list[int]:
        return self.tokenizer.encode(self.template.format(prompt=self.rows[i]["prompt"]))

    def prompt_lengths(self) -> Iterator[tuple[str, int]]:
        for i in range(len(self.rows)):
            yield f"task.path row {i} ({self.file}:{self.lines[i]}, with task.template)", len(self._ids(i))

    def prompts(self, step: int) -> list[Prompt]:
        order = torch.randperm(len(self.rows), generator=self._generator(step // max(1, len(self.rows))))
        start = (step * self.prompts_per_step) % len(self.rows)
        picks = [int(order[(start + i) % len(self.rows)]) for i in range(self.prompts_per_step)]
        return [Prompt(ids=self._ids(i), meta=self.rows[i]) for i in picks]


def make_task(cfg: Mapping[str, Any], vocab_size: int, seed: int, tokenizer: Tokenizer | None = None) -> Task:
    """Build ``cfg`` (the ``task`` group as configured, ``Settings.config["task"]``; ``residue`` or ``jsonl``:
    :func:`build_tasks` builds ``dataset``) for a model with ``vocab_size`` tokens."""
    kind = str(cfg["name"])
    if kind not in TASKS:
        raise TaskError(f"task.name={kind!r} is not allowed; allowed values: {list(TASKS)}")
    if kind == "dataset":
        raise TaskError("task.name='dataset' reads the data group: build it with build_tasks")
    tokenizer = tokenizer or checked_tokenizer(str(cfg.get("tokenizer") or "bytes"), vocab_size)
    reward = resolve_reward(str(cfg["reward"]))
    n = int(cfg["prompts_per_step"])
    if kind == "residue":
        return ResidueTask(reward, tokenizer, n, seed, vocab_size=vocab_size, prompt_len=int(cfg["prompt_len"]),
                           modulus=int(cfg["modulus"]), conditional=bool(cfg.get("conditional", False)))  # fmt: skip
    return JsonlTask(reward, tokenizer, n, seed, path=str(cfg["path"]), template=str(cfg["template"]))


def checked_tokenizer(spec: str, vocab_size: int) -> Tokenizer:
    tokenizer = make_tokenizer(spec)
    if getattr(tokenizer, "vocab_size", vocab_size) > vocab_size:
        raise TaskError(f"task.tokenizer has {tokenizer.vocab_size} tokens, more than the model's {vocab_size}")
    return tokenizer


@dataclass
class Tasks:
    """A run's prompts: the training task, the validation set (``rl.val_every`` > 0) and the stop tokens."""

    train: Task
    val: Any = None  # megatron_iso.rl.data.DatasetTask over data.val_files
    stop_ids: tuple[int, ...] = ()

    def identity(self) -> dict[str, str]:
        """What a checkpoint records of the training data, for a resume to match (dataset tasks only)."""
        return self.train.identity() if hasattr(self.train, "identity") else {}

    def summary(self) -> dict[str, Any]:
        """Rows, prompts dropped by length, chat template: the run summary's data keys."""
        return {k: v for t in (self.train, self.val) if hasattr(t, "summary") for k, v in t.summary().items()}

    def step_metrics(self, step: int) -> dict[str, float]:
        """``data/epoch``: epochs of the training rows consumed before ``step`` (dataset tasks)."""
        progress = getattr(self.train, "epoch_progress", None)
        return {} if progress is None else {"data/epoch": progress(step)}


# --- prompt lengths against the rollout's limits -------------------------------------------------------------------


def check_prompts_fit(task: Task, refusal: Callable[[int], str | None]) -> None:
    """Refuse, before the first step, a task holding a prompt the rollout would refuse when its row comes up.
    ``refusal(n)``: why a prompt of ``n`` tokens cannot run (naming the setting to change), None when it can
    (:func:`rollout_refusal`). The error names the first such prompt and its length."""
    verdicts: dict[int, str | None] = {}
    for where, n in task.prompt_lengths():
        if n not in verdicts:
            verdicts[n] = "the prompt is empty" if n == 0 else refusal(n)
        if verdicts[n] is not None:
            raise TaskError(f"{where} has {n} tokens: {verdicts[n]}")


def rollout_refusal(engine: Any, max_new_tokens: int, group_size: int) -> Callable[[int], str | None]:
    """For :func:`check_prompts_fit`: the admission checks of ``engine`` (a
    :class:`~megatron_iso.inference.engine.RolloutEngine`) for a prompt of ``n`` tokens sampled ``group_size``
    times with up to ``max_new_tokens`` new tokens, as its ``add_request`` applies them."""

    def refusal(n: int) -> str | None:
        limit = engine.max_model_len
        if n >= limit:
            return (
                f"the model runs at most {limit} tokens per sequence, prompt and response (model.max_position_embeddings"
                f"={limit}); shorten the prompt, or raise model.max_position_embeddings for a model that allows it"
            )
        total = min(n + max_new_tokens, limit)
        for cache in engine.caches:
            need, have = cache.cost(n, total, group_size, engine.config.prefix_caching, 0), cache.capacity()
            if need <= have:
                continue
            if cache is not engine.kv:  # recurrent-state slots: one per running sample, whatever its length
                return f"rl.group_size={group_size} samples need {need} {cache.kind} slots, the rollout holds {have}"
            return (
                f"its rl.group_size={group_size} samples of up to {total} tokens need {need} KV-cache blocks, the "
                f"rollout holds {have}; raise rollout.kv_cache_mb, or lower rl.max_response_length or rl.group_size"
            )
        return None

    return refusal
