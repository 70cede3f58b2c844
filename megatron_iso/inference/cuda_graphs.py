"""Decode steps replayed from CUDA graphs, one graph per batch bucket.

Why: a decode step of a small model is bound by host work, not by the GPU. On the H200, Qwen3-0.6B
took 55-61 ms per step at every batch size from 1 to 256 (about 2 ms of Python and launches per
layer, docs/PERFORMANCE.md); replayed from a graph, the iso step took ~5 ms at batch 1.

How: for a bucket of ``B`` rows, :class:`DecodeGraphs` owns a static decode batch built by
``models.batch.pack``: token ids, positions, cache start positions, slots, a ``[B, W]`` block table
(``W`` blocks: the longest sequence the engine admits) and the pool row each row writes. A step with
``n <= B`` sequences copies the engine's own pack and KV step view into rows ``0..n-1`` and replays;
rows ``n..B-1`` are padding (token 0 at position 0, a table of the cache's reserved scratch block,
writes into that block) and their logits are dropped. The graph reads nothing from the host: the
batch's ``KVStepPlan`` is marked ``device_positions`` (its host starts are placeholders), the
attention takes start positions from the device tensors, RoPE's cos/sin and the staging rows are
computed inside the graph.

- Correctness profile (paged reads): the Triton kernel reads the pool through the block table, so a
  bucket is a row count. Padding is free of numerical effect because the profile is batch invariant (a
  row's bits depend on that row alone), so a replayed step gives the eager step's tokens and logprobs
  bit for bit: ``tests/inference/test_decode_graphs.py`` runs the buffers eagerly on CPU,
  ``tests/gpu/test_decode_graphs.py`` holds the captured engine to the eager one on a GPU.
- Performance profile (the native baseline): attention stages each layer's KV history, so a bucket is
  a row count and a staging length (:func:`staging_length`, at most 2x the longest sequence). Native
  kernels are not batch invariant: padding rows and masked staging columns may move its last bits, as
  any batch change does there.

What stays eager: prefill steps (their shapes vary with the prompts) and steps with more rows than
the largest bucket. :func:`decode_graph_support` says which models and configs are captured.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from megatron_iso.contract.registry import Profile
from megatron_iso.inference.draw import Drawer
from megatron_iso.inference.kv_blocks import PagedKVCache, PagedStepView
from megatron_iso.inference.state import StepState
from megatron_iso.models.batch import IsoBatch, pack
from megatron_iso.ops.logprob import host_checked_temperature

MIN_STAGING = 256  # tokens: the shortest staging length bucket (performance profile)


def decode_graph_support(model: torch.nn.Module, *, paged_kv_reads: bool) -> str | None:
    """None when the engine can capture ``model``'s decode steps; otherwise why it cannot."""
    from megatron_iso.models.gdn import gdn_layer_indices

    mc = model.config
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (the model is on {device})"
    if mc.iso_profile == Profile.CORRECTNESS and not paged_kv_reads:
        return "paged_kv_reads=False: the correctness profile's staged attention reads positions on the host"
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


def staging_length(need: int, block_size: int, width: int) -> int:
    """The staging length bucket for a step whose longest sequence holds ``need`` tokens: the next power
    of two from :data:`MIN_STAGING` on (so under 2x ``need`` past 128 tokens), in whole blocks, at most the
    table's ``width`` blocks."""
    length = max(MIN_STAGING, 1 << (max(need, 1) - 1).bit_length())
    return min(-(-length // block_size), width) * block_size


@dataclass
class _Bucket:
    rows: int
    ids: torch.Tensor  # [1, rows]
    batch: IsoBatch
    view: PagedStepView  # the bucket's device-laid-out KV view
    keys: torch.Tensor  # [rows, 2] int64: the draw's row keys
    temp: torch.Tensor  # [rows, 1] fp32, marked host-checked (the engine checks each step's values)
    greedy: torch.Tensor  # [rows] bool
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    drawn: tuple[torch.Tensor, torch.Tensor] | None = None  # the recorded draw: tokens, logprobs [rows]
    live: int = 0  # rows holding a sequence since the last step (the rest are padding already)


class DecodeGraphs:
    """The engine's ``forward_fn`` for decode steps: static buffers per bucket, replayed graphs.

    ``paged``: the attention reads the pool in place (correctness profile's Triton kernel); otherwise it
    stages each layer's history and buckets also carry a staging length. ``capture=False`` runs the same
    static buffers eagerly (no graph): how the CPU tests check the padding and the copies, and a
    fallback when a capture fails.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: PagedKVCache,
        *,
        width: int,
        max_rows: int,
        paged: bool,
        capture: bool,
        buckets: list[int] | None = None,
        drawer: Drawer | None = None,
    ) -> None:
        self.model, self.kv, self.width, self.paged, self.capture = model, kv, width, paged, capture
        self.drawer = drawer  # records the step's Gumbel draw after the forward (None: logits only)
        self._last: tuple[_Bucket, int] | None = None
        self.buckets = sorted(buckets) if buckets else default_buckets(max_rows)
        if self.buckets[0] < 1:
            raise ValueError(f"decode graph buckets must be >= 1, got {self.buckets}")
        self.scratch = kv.reserve_block()
        self.device = next(iter(kv.k.values())).device
        self._buckets: dict[tuple[int, int | None], _Bucket] = {}
        self._pool = None
        self.steps = 0  # decode steps served from bucket buffers
        self.replays = 0  # of which replayed from a captured graph
        self.captures = 0
        self.disabled: str | None = None  # why capture stopped (a failed capture falls back to eager replays)
        self._param_ptrs: list[int] = []

    # --- the hook ---------------------------------------------------------------------------
    def __call__(
        self, ids: torch.Tensor, batch: IsoBatch, draw_inputs: tuple[torch.Tensor, ...] | None = None
    ) -> torch.Tensor:
        """Logits ``[n, V/tp]`` of a step. For a bucketed decode step they are a view of the graph's
        output buffer, valid until the next decode step (the engine samples from them before that).
        ``draw_inputs``: the rows' (keys, temperatures, greedy flags) for the recorded draw (:meth:`drawn`)."""
        n = int(ids.shape[1])
        self._last = None
        if batch.case != "decode" or n > self.buckets[-1]:
            return self.model.forward_packed(ids, batch)
        step_view = batch.kv_cache.state(PagedKVCache.kind)
        bucket = self._bucket(self._key(n, step_view.shape[1]))
        self._load(bucket, ids, batch, step_view)
        if draw_inputs is not None and self.drawer is not None:
            keys, temp, greedy = draw_inputs
            bucket.keys[:n].copy_(keys)
            bucket.temp[:n, 0].copy_(temp)
            bucket.greedy[:n].copy_(greedy)
            self._last = (bucket, n)
        self.steps += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
        else:
            bucket.logits = self._run(bucket)
        return bucket.logits[:n]

    def drawn(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last step's recorded draw (tokens, logprobs of its ``n`` rows), if it ran from a bucket with
        draw inputs; valid until the next decode step."""
        if self._last is None:
            return None
        bucket, n = self._last
        return bucket.drawn[0][:n], bucket.drawn[1][:n]

    def warm(self, rows: int, length: int = 1) -> None:
        """Capture the bucket serving ``rows`` sequences of up to ``length`` tokens now rather than at its
        first step (a benchmark's warm-up: capture time is not decode time)."""
        if rows <= self.buckets[-1]:
            self._bucket(self._key(rows, length))

    def parameters_moved(self) -> bool:
        """True when a parameter's storage changed since capture (graphs read the old addresses)."""
        return bool(self._param_ptrs) and self._param_ptrs != [p.data_ptr() for p in self.model.parameters()]

    def drop(self) -> None:
        """Forget every captured graph (re-captured on next use)."""
        for b in self._buckets.values():
            b.graph, b.logits, b.drawn = None, None, None  # these live in the graphs' pool: let them go
            b.batch.memo.clear()
        self._pool, self._param_ptrs = None, []

    # --- static buffers -----------------------------------------------------------------------
    def _key(self, rows: int, length: int) -> tuple[int, int | None]:
        bucket_rows = next(b for b in self.buckets if b >= rows)
        return bucket_rows, None if self.paged else staging_length(length, self.kv.block_size, self.width)

    def _bucket(self, key: tuple[int, int | None]) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            rows, length = key
            tables = torch.empty((rows, self.width), dtype=torch.int64, device=self.device)
            write = torch.empty(rows, dtype=torch.int64, device=self.device)
            seqlens = torch.empty(rows, dtype=torch.int64, device=self.device)
            view = PagedStepView.on_device(self.kv, tables, write, seqlens, length or self.width * self.kv.block_size)
            ids, batch = pack(
                [[0]] * rows,
                start_positions=[0] * rows,
                case="decode",
                kv_cache=StepState({PagedKVCache.kind: view}, paged=self.paged),
                slots=range(rows),
                device=self.device,
            )
            batch.cache_seqlens = seqlens  # the view's write-back rows read the same tensor
            batch.kv_plan.device_positions = True  # its host starts (all 0) are placeholders
            keys = torch.zeros((rows, 2), dtype=torch.int64, device=self.device)
            temp = torch.ones((rows, 1), dtype=torch.float32, device=self.device)
            host_checked_temperature(temp, torch.ones((rows, 1)))
            greedy = torch.ones(rows, dtype=torch.bool, device=self.device)
            bucket = self._buckets[key] = _Bucket(rows, ids, batch, view, keys, temp, greedy, live=rows)
            self._to_padding(bucket, 0)  # every row starts as padding
        if bucket.graph is None and self.capture and self.disabled is None:
            self._to_padding(bucket, 0)  # the warm-up runs must write nowhere but the scratch block
            self._capture(bucket)
        return bucket

    def _to_padding(self, bucket: _Bucket, first: int) -> None:
        """Rows ``first..`` become padding: token 0 at position 0, reading and writing the scratch block."""
        if bucket.live > first:
            view, sb, end = bucket.view, bucket.batch, bucket.live
            bucket.ids[:, first:end].zero_()
            sb.positions[first:end].zero_()
            sb.cache_seqlens[first:end].zero_()
            view.write_idx[first:end].fill_(self.scratch * self.kv.block_size)
            view.block_tables[first:end].fill_(self.scratch)
            bucket.keys[first:end].zero_()  # padding draws greedily at temperature 1: finite, never read
            bucket.temp[first:end].fill_(1.0)
            bucket.greedy[first:end].fill_(True)
        bucket.live = min(bucket.live, first)

    def _load(self, bucket: _Bucket, ids: torch.Tensor, batch: IsoBatch, step_view: PagedStepView) -> None:
        """The step's rows into the bucket's buffers; rows no longer live go back to padding."""
        n = int(ids.shape[1])
        tables = step_view.host_block_tables
        if tables.shape[1] > self.width:
            raise ValueError(f"decode step needs {tables.shape[1]} blocks per sequence; graphs hold {self.width}")
        view, sb = bucket.view, bucket.batch
        bucket.ids[:, :n].copy_(ids)
        sb.positions[:n].copy_(batch.positions)
        sb.cache_seqlens[:n].copy_(batch.cache_seqlens)
        view.write_idx[:n].copy_(step_view.write_idx)
        # Columns past this step's width keep older ids: valid blocks the kernel never reads (masked keys).
        view.block_tables[:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        # A row left by a finished sequence must not keep writing into blocks another sequence may now hold.
        self._to_padding(bucket, n)
        bucket.live = n  # rows 0..n-1 now hold sequences (padding ones included, when n grew)

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        """One step on the bucket's buffers (what a graph records): forward, then the last write-back."""
        bucket.batch.memo.clear()  # RoPE cos/sin of the new positions
        bucket.view.discard()  # nothing left over from a warm-up or capture that raised mid-forward
        logits = self.model.forward_packed(bucket.ids, bucket.batch)
        bucket.batch.kv_cache.finish()
        if self.drawer is not None:
            bucket.drawn = self.drawer.plain(logits, bucket.keys, bucket.temp, bucket.greedy)
        return logits

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up (compiles kernels, builds the bucket's host-made tables), then record one step."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.logits = self._run(bucket)
        except Exception as exc:  # a capture-unsafe op (or a failed compile): serve the bucket eagerly, say why
            self.disabled = f"capture of the {bucket.rows}-row decode step failed: {exc}"
            warnings.warn(f"DecodeGraphs: {self.disabled}; decode steps run eagerly", stacklevel=3)
            torch.cuda.synchronize(self.device)
            return
        self._pool = graph.pool()
        bucket.graph = graph
        self.captures += 1
        if not self._param_ptrs:
            self._param_ptrs = [p.data_ptr() for p in self.model.parameters()]
