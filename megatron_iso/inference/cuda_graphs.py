"""Decode steps replayed from CUDA graphs, one graph per batch bucket.

Why: a decode step of a small model is bound by host work, not by the GPU. On the H200, Qwen3-0.6B
took 55-61 ms per step at every batch size from 1 to 256 (about 2 ms of Python and launches per
layer, docs/PERFORMANCE.md). A captured graph replays all of a step's kernels in one call.

How: for a bucket of ``B`` rows, :class:`DecodeGraphs` owns a static decode batch built by
``models.batch.pack``: token ids, positions, cache start positions, slots, a ``[B, W]`` block table
(``W`` blocks: the longest sequence the engine admits) and the pool row each row writes. A step with
``n <= B`` sequences copies the engine's own pack and KV step view into rows ``0..n-1`` and replays;
rows ``n..B-1`` are padding (token 0 at position 0, a table of the cache's reserved scratch block,
writes into that block) and their logits are dropped. The graph reads nothing from the host: the
Triton attention takes start positions and ``cu_seqlens`` from these device tensors (its host-built
tables depend only on the bucket), and RoPE's cos/sin are computed inside the graph.

Padding is free of numerical effect because the correctness profile is batch invariant: a row's bits
depend on that row alone (the property ``tests/inference/test_engine_bitwise.py`` holds across batch
sizes). So a replayed step gives the eager step's tokens and logprobs bit for bit:
``tests/inference/test_decode_graphs.py`` runs the static path eagerly on CPU, and
``tests/gpu/test_decode_graphs.py`` holds the captured engine to the eager one on a GPU.

What stays eager: prefill steps (their shapes vary with the prompts) and steps with more rows than
the largest bucket. :func:`decode_graph_support` says which models and configs are captured.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_iso.inference.kv_blocks import PagedKVCache, PagedStepView
from megatron_iso.inference.state import StepState
from megatron_iso.models.batch import IsoBatch, pack
from megatron_iso.ops.attention.kv_cache import PagedKVLayer


def decode_graph_support(model: torch.nn.Module, *, paged_kv_reads: bool) -> str | None:
    """None when the engine can capture ``model``'s decode steps; otherwise why it cannot."""
    from megatron_iso.models.gdn import gdn_layer_indices

    mc = model.config
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (the model is on {device})"
    if mc.iso_profile != "correctness":
        return (
            f"iso_profile={mc.iso_profile!r}: the performance profile's attention stages the KV cache per step "
            "(its width changes every step); only the correctness profile's paged Triton attention has fixed shapes"
        )
    if not paged_kv_reads:
        return "paged_kv_reads=False stages the KV cache per step (its width changes every step)"
    if mc.tensor_model_parallel_size > 1:
        return (
            f"tensor_model_parallel_size={mc.tensor_model_parallel_size}: TP collectives are not captured (TP 1 only)"
        )
    if gdn_layer_indices(mc):
        return "Gated DeltaNet layers: their per-step state layout is not captured yet"
    if mc.num_moe_experts:
        return "MoE layers: expert batch sizes are planned on the host every step"
    return None


def default_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 32, of 16 to 128, of 32 beyond, capped by (and ending at) ``max_rows``:
    padding wastes at most a few rows' work at every batch size."""
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 32 else 16 if b < 128 else 32)
    return [*sizes, max_rows]


class _StaticKV:
    """A bucket's attention view: the engine's pool with the bucket's own block table and write rows."""

    paged = True

    def __init__(self, cache: PagedKVCache, block_tables: torch.Tensor, write_idx: torch.Tensor) -> None:
        self.cache, self.block_tables, self.write_idx = cache, block_tables, write_idx

    def paged_layer(self, index: int) -> PagedKVLayer:
        return PagedKVLayer(self.cache.k[index], self.cache.v[index], self.block_tables, self.write_idx)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("a captured decode step reads the paged pool in place; it has no staging view")


@dataclass
class _Bucket:
    rows: int
    ids: torch.Tensor  # [1, rows]
    batch: IsoBatch
    kv: _StaticKV
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    live: int = 0  # rows holding a sequence since the last step (the rest are padding already)


class DecodeGraphs:
    """The engine's ``forward_fn`` for decode steps: static buffers per bucket, replayed graphs.

    ``capture=False`` runs the same static buffers eagerly (no graph): how the CPU tests check the
    padding and the copies, and a fallback when a capture fails.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: PagedKVCache,
        *,
        width: int,
        max_rows: int,
        capture: bool,
        buckets: list[int] | None = None,
    ) -> None:
        self.model, self.kv, self.width, self.capture = model, kv, width, capture
        self.forward: Callable[[torch.Tensor, IsoBatch], torch.Tensor] = model.forward_packed
        self.buckets = sorted(buckets) if buckets else default_buckets(max_rows)
        if self.buckets[0] < 1:
            raise ValueError(f"decode graph buckets must be >= 1, got {self.buckets}")
        self.scratch = kv.reserve_block()
        self.device = next(iter(kv.k.values())).device
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self.steps = 0  # decode steps served from bucket buffers
        self.replays = 0  # of which replayed from a captured graph
        self.captures = 0
        self.disabled: str | None = None  # why capture stopped (a failed capture falls back to eager replays)
        self._param_ptrs: list[int] = []

    # --- the hook ---------------------------------------------------------------------------
    def __call__(self, ids: torch.Tensor, batch: IsoBatch) -> torch.Tensor:
        n = int(ids.shape[1])
        if batch.case != "decode" or n > self.buckets[-1]:
            return self.forward(ids, batch)
        bucket = self._bucket(next(b for b in self.buckets if b >= n))
        self._load(bucket, ids, batch, batch.kv_cache.state(PagedKVCache.kind))
        self.steps += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
        else:
            bucket.batch.memo.clear()  # RoPE cos/sin of the new positions
            bucket.logits = self.forward(bucket.ids, bucket.batch)
        return bucket.logits[:n]

    def warm(self, rows: int) -> None:
        """Capture the bucket serving ``rows`` sequences now rather than at its first step (a
        benchmark's warm-up: capture time is not decode time)."""
        if rows <= self.buckets[-1]:
            self._bucket(next(b for b in self.buckets if b >= rows))

    def parameters_moved(self) -> bool:
        """True when a parameter's storage changed since capture (graphs read the old addresses)."""
        return bool(self._param_ptrs) and self._param_ptrs != [p.data_ptr() for p in self.model.parameters()]

    def drop(self) -> None:
        """Forget every captured graph (re-captured on next use)."""
        for b in self._buckets.values():
            b.graph = None
        self._pool, self._param_ptrs = None, []

    # --- static buffers -----------------------------------------------------------------------
    def _bucket(self, rows: int) -> _Bucket:
        bucket = self._buckets.get(rows)
        if bucket is None:
            bs = self.kv.block_size
            tables = torch.full((rows, self.width), self.scratch, dtype=torch.int64, device=self.device)
            write = torch.full((rows,), self.scratch * bs, dtype=torch.int64, device=self.device)
            kv = _StaticKV(self.kv, tables, write)
            ids, batch = pack(
                [[0]] * rows,
                start_positions=[0] * rows,
                case="decode",
                kv_cache=StepState({PagedKVCache.kind: kv}, paged=True),
                slots=range(rows),
                device=self.device,
            )
            bucket = self._buckets[rows] = _Bucket(rows, ids, batch, kv)
        if bucket.graph is None and self.capture and self.disabled is None:
            self._to_padding(bucket, 0)  # the warm-up runs must write nowhere but the scratch block
            self._capture(bucket)
        return bucket

    def _to_padding(self, bucket: _Bucket, first: int) -> None:
        """Rows ``first..`` become padding: token 0 at position 0, reading and writing the scratch block."""
        if bucket.live > first:
            kv, sb, end = bucket.kv, bucket.batch, bucket.live
            bucket.ids[:, first:end].zero_()
            sb.positions[first:end].zero_()
            sb.cache_seqlens[first:end].zero_()
            kv.write_idx[first:end].fill_(self.scratch * self.kv.block_size)
            kv.block_tables[first:end].fill_(self.scratch)
        bucket.live = min(bucket.live, first)

    def _load(self, bucket: _Bucket, ids: torch.Tensor, batch: IsoBatch, view: PagedStepView) -> None:
        """The step's rows into the bucket's buffers; rows no longer live go back to padding."""
        n = int(ids.shape[1])
        tables = view.host_block_tables
        if tables.shape[1] > self.width:
            raise ValueError(f"decode step needs {tables.shape[1]} blocks per sequence; graphs hold {self.width}")
        kv, sb = bucket.kv, bucket.batch
        bucket.ids[:, :n].copy_(ids)
        sb.positions[:n].copy_(batch.positions)
        sb.cache_seqlens[:n].copy_(batch.cache_seqlens)
        kv.write_idx[:n].copy_(view.write_idx)
        # Columns past this step's width keep older ids: valid blocks the kernel never reads (masked keys).
        kv.block_tables[:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        # A row left by a finished sequence must not keep writing into blocks another sequence may now hold.
        self._to_padding(bucket, n)
        bucket.live = n

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up (compiles kernels, builds the bucket's host-made tables), then record one step."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    bucket.batch.memo.clear()
                    self.forward(bucket.ids, bucket.batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            bucket.batch.memo.clear()  # per-step device values (RoPE cos/sin) are computed inside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.logits = self.forward(bucket.ids, bucket.batch)
        except RuntimeError as exc:  # a capture-unsafe op: keep serving the bucket eagerly, say why
            self.disabled = f"capture of the {bucket.rows}-row decode step failed: {exc}"
            warnings.warn(f"DecodeGraphs: {self.disabled}; decode steps run eagerly", stacklevel=3)
            torch.cuda.synchronize(self.device)
            return
        self._pool = graph.pool()
        bucket.graph = graph
        self.captures += 1
        if not self._param_ptrs:
            self._param_ptrs = [p.data_ptr() for p in self.model.parameters()]
