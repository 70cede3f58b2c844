"""One engine step's token draw: the per-row inputs made on the host, the draw on the device.

:func:`plan_draw` turns a step's sampling rows (request parameters, row keys from (seed, request id,
sample index, position)) into one host tensor and one non-blocking copy. :class:`Drawer` draws from the
step's logits by the sampler's per-row rule (``sampler`` module doc) and records each token's logprob with
the trainer's scoring function. :meth:`Drawer.plain` is the part a CUDA graph records after the decode
forward (Gumbel-max and the recorded logprob of every row); :meth:`Drawer.draw` finishes a step: it takes
the graph's draw as it is when no row filters and none asks for top logprobs, and otherwise draws the
filtered rows by sort and scan and records the merged tokens' logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_iso.inference.params import SamplingParams
from megatron_iso.inference.rng import row_words, word_uniform
from megatron_iso.inference.sampler import gumbel_tokens, select_tokens, top_logprobs
from megatron_iso.ops.logprob import host_checked_temperature
from megatron_iso.parallel.tree_collectives import gather_along
from megatron_iso.parallel.vocab_scoring import log_softmax, token_logprobs

# Rows of DrawPlan.host / on_dev.
SRC, GREEDY, TEMP, TOP_K, TOP_P, UNIFORM, KEY0, KEY1, FILTERED = range(9)


@dataclass
class DrawPlan:
    """A step's sampling rows: ``src[r]`` the logits row that row ``r`` draws from; ``host`` the per-row
    inputs (float64 holds every value exactly: ids, counts and 32-bit key words below 2**53, the fp32
    temperatures, top-p values and uniforms), :attr:`on_dev` its device copy."""

    src: list[int]
    params: list[SamplingParams]
    filtered: list[bool]
    host: torch.Tensor
    device: torch.device
    _on_dev: torch.Tensor | None = None

    @property
    def on_dev(self) -> torch.Tensor:
        """``host`` on the device, copied at first use: a decode graph's step reads ``host`` itself."""
        if self._on_dev is None:
            # One non-blocking copy: a blocking copy per tensor would be a host sync each on GPU.
            self._on_dev = self.host.to(self.device, non_blocking=True)
        return self._on_dev

    @property
    def top_k_logprobs(self) -> int:
        return max(p.top_logprobs for p in self.params)

    @property
    def graph_drawable(self) -> bool:
        """A decode graph's draw is the step's draw: no row filters, none asks for top logprobs."""
        return not any(self.filtered) and self.top_k_logprobs == 0

    def graph_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row keys ``[R, 2]`` int64, temperatures ``[R]`` fp32 (greedy rows 1.0) and greedy flags ``[R]``."""
        d = self.on_dev
        return d[KEY0 : KEY1 + 1].t().long(), d[TEMP].float(), d[GREEDY] != 0


def plan_draw(
    src: list[int], params: list[SamplingParams], counters: list[tuple[int, int, int, int]], device: torch.device
) -> DrawPlan:
    """``counters[r]`` = (seed, request key, sample index, position of the drawn token) of row ``r``, each in
    [0, 2**64)."""
    # Per row, the rule (sampler module doc): Gumbel-max unless top-k / top-p filter the row.
    filtered = [p.temperature != 0 and (p.top_k > 0 or p.top_p < 1) for p in params]
    # numpy throughout: a host step builds this for every row, and a torch op per list costs more than the rows.
    words = row_words(*(np.array([c[i] for c in counters], dtype=np.uint64) for i in range(4)))
    table = np.empty((FILTERED + 1, len(params)), dtype=np.float64)
    table[SRC] = src
    table[GREEDY] = [p.temperature == 0 for p in params]
    table[TEMP] = np.array([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=np.float32)
    table[TOP_K] = [p.top_k for p in params]
    table[TOP_P] = np.array([p.top_p for p in params], dtype=np.float32)
    table[UNIFORM] = word_uniform(words[0]) if any(filtered) else 0.0
    table[KEY0], table[KEY1] = words[0], words[1]
    table[FILTERED] = filtered
    return DrawPlan(src, params, filtered, torch.from_numpy(table), torch.device(device))


class Drawer:
    """Draws and records tokens for one model (its TP group, leaves and profile)."""

    def __init__(self, model_config: Any, profile: str) -> None:
        self.leaves, self.profile = model_config.iso_leaves, profile

    def _common(self) -> dict[str, Any]:
        group = (
            parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
        )
        return {"group": group, "leaves": self.leaves, "profile": self.profile}

    def plain(
        self, logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gumbel-max tokens of every row and their recorded logprobs (no host read: graph-safe).
        ``temperature [R, 1]`` must be marked host-checked by the caller (``ops.logprob.host_checked_temperature``)."""
        common = self._common()
        tokens = gumbel_tokens(logits, keys, temperature.squeeze(-1), greedy, group=common["group"])
        return tokens, token_logprobs(logits, tokens, temperature=temperature, ids_in_range=True, **common)

    def draw(
        self, plan: DrawPlan, logits: torch.Tensor, drawn: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Tokens, recorded logprobs and top logprobs (ids, values; None when no row asks) of the plan's rows.
        ``drawn``: a decode graph's :meth:`plain` output for these rows, used as it is when the plan allows."""
        if drawn is not None and plan.graph_drawable:
            return drawn[0], drawn[1], None
        d = plan.on_dev
        # The temperatures are host values (validated, greedy rows at 1.0): checked here, so the
        # scoring ops do not read them back from the device (2 host syncs per step on GPU).
        temp = host_checked_temperature(d[TEMP].float().unsqueeze(-1), plan.host[TEMP].float().unsqueeze(-1))
        # A decode step samples every row once, in order: the logits rows are used as they are.
        rows = logits if plan.src == list(range(logits.shape[0])) else logits.index_select(0, d[SRC].long())
        common = self._common()
        keys, temp_rows, greedy = plan.graph_inputs()
        k = plan.top_k_logprobs
        tokens = None
        if not all(plan.filtered):
            tokens = (
                drawn[0] if drawn is not None else gumbel_tokens(rows, keys, temp_rows, greedy, group=common["group"])
            )
        logp = None
        if any(plan.filtered) or k:
            logp = gather_along(log_softmax(rows, temperature=temp, **common), common["group"], dim=-1)
        if any(plan.filtered):
            picked = select_tokens(
                logp, d[UNIFORM].float(), greedy=greedy, top_k=d[TOP_K].long(), top_p=d[TOP_P].float()
            )
            tokens = picked if tokens is None else torch.where(d[FILTERED] != 0, picked, tokens)
        # Both rules draw from this vocab: no range check (it was the step's second host read).
        recorded = token_logprobs(rows, tokens, temperature=temp, ids_in_range=True, **common)
        return tokens, recorded, top_logprobs(logp, k) if k else None
