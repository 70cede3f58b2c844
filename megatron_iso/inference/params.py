"""Requests, sampling parameters and results of the rollout engine.

Parameters are validated when the engine admits a request, not when they are built: an invalid
field becomes that request's error result (naming the field and the allowed values) while the
other requests of the call finish.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FINISH_REASONS = ("stop", "length", "error")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's ``n`` continuations.

    temperature: 0 = greedy (argmax, ties to the lowest token id; logprobs then recorded at
    temperature 1); > 0 scales the logits before softmax, filtering and sampling.
    top_k: 0 = off. top_p: in (0, 1], 1 = off. max_new_tokens >= 1. stop_token_ids: sampling one
    ends the sample (it is kept, with its logprob). n: samples sharing the prompt. seed: the
    counter-based generator's key (with the request id, sample index and position).
    top_logprobs: record this many most likely tokens (and their logprobs) per position.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int = 0
    top_logprobs: int = 0

    def finish_reason(self, tokens: Sequence[int], prompt_len: int, max_model_len: int) -> str | None:
        """Why a sample that drew ``tokens`` ends now ("stop", "length"), None when it goes on."""
        if tokens[-1] in self.stop_token_ids:
            return "stop"
        if len(tokens) >= self.max_new_tokens or prompt_len + len(tokens) >= max_model_len:
            return "length"
        return None

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first invalid field and its allowed values."""
        _check(
            isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a finite number >= 0 (0 = greedy)",
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an int >= 0 (0 = off)")
        _check(isinstance(self.top_p, int | float) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1")
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        _check(_is_int(self.seed) and 0 <= self.seed < 1 << 64, "seed", self.seed, "an int in [0, 2**64)")
        _check(
            _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= vocab_size,
            "top_logprobs",
            self.top_logprobs,
            f"an int in [0, {vocab_size}]",
        )
        _check(
            isinstance(self.stop_token_ids, Sequence)
            and all(_is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            f"a sequence of token ids in [0, {vocab_size})",
        )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class Request:
    """A token-id prompt. ``request_id`` keys the random draws: give the same id (and seed) to
    reproduce a request's samples whatever else runs with it."""

    request_id: int | str
    prompt: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class SampleOutput:
    """One continuation: ``tokens[i]`` was drawn with raw temperature-scaled logprob ``logprobs[i]``
    (fp32, the trainer's scoring function on the logits of the step that produced it)."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    # With EngineConfig.record_routing (MoE): [prompt + response - 1, layers, k] int64, the experts each position
    # was routed to in its forward (the last token never was an input); on the engine's device.
    routing: torch.Tensor | None = None


@dataclass
class RequestOutput:
    """All samples of a request; ``error`` set (and ``samples`` empty) when it could not run."""

    request_id: int | str
    prompt: list[int]
    samples: list[SampleOutput] = field(default_factory=list)
    error: str | None = None
    weights_version: int = 0

    @property
    def finished(self) -> bool:
        return self.error is not None or (bool(self.samples) and all(s.finish_reason is not None for s in self.samples))
