"""Attention for some of a pack's queries against all of its keys: the context-parallel case.

Under context parallelism (``parallel.context``) a rank holds a subset of the packed rows, as runs of
consecutive positions of one sequence each (:class:`QueryRuns`), and the keys and values of every row,
gathered in the original packed order. Each run is exactly what a prefill continuation is to the KV-cache
kernel: queries at positions ``start ..`` of a sequence whose keys ``0 ..`` are cached. So the forward stages
each sequence's gathered keys as one cache row and calls the registered ``attention_kvcache`` implementation
(``ops.attention.attention_with_kv_cache``): the same kernel, fixed key blocks and reduction order as the
trainer's ``attention_varlen`` at CP 1, whose bits it equals for every query (the contract's equivalence of
prefill with trainer_forward; a query's arithmetic depends only on its position and keys ``0..p``).

The backward is the plain fp32 formula (``ops.common.autograd``), per run: deterministic, gradients for the
local queries and for every gathered key and value (the caller's all-gather sums the keys' over ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from megatron_iso.ops.attention.kv_cache import KVStepPlan
from megatron_iso.ops.common.autograd import with_plain_backward


@dataclass(frozen=True)
class QueryRuns:
    """Local query rows as runs, each of consecutive positions of one sequence (host lists).

    Run ``i`` holds local rows ``cu[i]:cu[i + 1]`` at positions ``starts[i] ..`` of sequence slot ``slots[i]``;
    slot ``s``'s keys are the gathered rows ``seq_first[s] ..``, of which the runs read the first
    ``seq_keys[s]`` (the end position of its last local query)."""

    cu: list[int]
    starts: list[int]
    slots: list[int]
    seq_first: list[int]
    seq_keys: list[int]
    _plan: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.cu) - 1
        if n < 0 or self.cu[0] != 0 or any(b <= a for a, b in pairwise(self.cu)):
            raise ValueError(f"QueryRuns: cu must start at 0 and increase, got {self.cu}")
        if len(self.starts) != n or len(self.slots) != n or len(self.seq_first) != len(self.seq_keys):
            raise ValueError("QueryRuns: one start and one slot per run, one first row and key count per slot")
        for i, (a, b) in enumerate(pairwise(self.cu)):
            if self.starts[i] < 0 or self.starts[i] + (b - a) > self.seq_keys[self.slots[i]]:
                raise ValueError(f"QueryRuns: run {i} reaches past its sequence's {self.seq_keys[self.slots[i]]} keys")

    @property
    def kv_plan(self) -> KVStepPlan:
        """The runs as a KV step (one per object: the attention layers share its memoised index tensors)."""
        if "plan" not in self._plan:
            self._plan["plan"] = KVStepPlan(list(self.cu), list(self.starts), list(self.slots))
        return self._plan["plan"]


def _staged(kv: torch.Tensor, runs: QueryRuns) -> torch.Tensor:
    """``[slots, longest, H, D]``: slot s holds its sequence's first ``seq_keys[s]`` gathered rows (zeros after:
    never read, the kernels mask keys past a query's position)."""
    out = kv.new_zeros(len(runs.seq_first), max(runs.seq_keys), *kv.shape[1:])
    for s, (first, n) in enumerate(zip(runs.seq_first, runs.seq_keys, strict=True)):
        out[s, :n] = kv[first : first + n]
    return out


def _run_rows(runs: QueryRuns, device: torch.device) -> torch.Tensor:
    """The gathered row of every local query (the cache kernel rewrites them into the staged rows: same bits)."""
    rows = [
        runs.seq_first[runs.slots[i]] + runs.starts[i] + j
        for i, (a, b) in enumerate(pairwise(runs.cu))
        for j in range(b - a)
    ]
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def _plain(q, k_full, v_full, gate, runs: QueryRuns, scale: float) -> torch.Tensor:
    """Causal GQA attention of each run against its sequence's keys, differentiable fp32 torch ops."""
    group = q.shape[1] // k_full.shape[1]
    outs = []
    for i, (a, b) in enumerate(pairwise(runs.cu)):
        first, start = runs.seq_first[runs.slots[i]], runs.starts[i]
        end = start + (b - a)
        qs = q[a:b].float().transpose(0, 1)  # [H, n, D]
        ks = k_full[first : first + end].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v_full[first : first + end].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(-1, -2)) * scale  # [H, n, end]
        q_pos = torch.arange(start, end, device=q.device)
        allowed = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append((probs @ vs).transpose(0, 1))
    out = torch.cat(outs)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out


def attention_query_runs(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    runs: QueryRuns,
    *,
    softmax_scale: float | None = None,
    gate: torch.Tensor | None = None,
    kv_block: int,
    profile: str,
) -> torch.Tensor:
    """Causal attention of the local queries ``q [n, Hq, D]`` (``runs``) against the gathered ``k_full`` /
    ``v_full [T, Hkv, D]`` of the whole pack: the bits of ``attention_varlen`` over the whole pack at those rows."""
    from megatron_iso.ops.attention import attention_with_kv_cache

    if q.shape[0] != runs.cu[-1]:
        raise ValueError(f"attention_query_runs: q has {q.shape[0]} rows, the runs {runs.cu[-1]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    plan = runs.kv_plan
    dev = q.device

    def invariant(q, k_full, v_full, gate):
        rows = plan.memo(("cp_rows", dev), lambda: _run_rows(runs, dev))
        starts = plan.memo(("cp_starts", dev), lambda: torch.tensor(runs.starts).to(dev, non_blocking=True))
        slots = plan.memo(("cp_slots", dev), lambda: torch.tensor(runs.slots).to(dev, non_blocking=True))
        cu = plan.memo(("cp_cu", dev), lambda: torch.tensor(runs.cu).to(dev, non_blocking=True))
        k_cache, v_cache = _staged(k_full, runs), _staged(v_full, runs)
        return attention_with_kv_cache(
            q, k_full[rows], v_full[rows], k_cache, v_cache, starts, cu, slots=slots, softmax_scale=scale,
            gate=gate, kv_block=kv_block, profile=profile, plan=plan,
        )  # fmt: skip

    def plain(q, k_full, v_full, gate):
        return _plain(q, k_full, v_full, gate, runs, scale)

    return with_plain_backward(invariant, plain, q, k_full, v_full, gate)
