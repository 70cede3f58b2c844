"""Decode steps replayed from CUDA graphs, one graph per batch bucket.

Why: a decode step of a small model is bound by host work, not by the GPU. On the H200, Qwen3-0.6B
took 55-61 ms per step at every batch size from 1 to 256 (about 2 ms of Python and launches per
layer, docs/PERFORMANCE.md); replayed from a graph, the iso step took ~5 ms at batch 1.

How: for a bucket of ``B`` rows, :class:`DecodeGraphs` owns a static decode batch built by
``models.batch.pack``: token ids, positions (= cached lengths), slots, a ``[B, W]`` block table
(``W`` blocks: the longest sequence the engine admits), the pool row each row writes and the draw's
inputs. A step with ``n <= B`` sequences (:meth:`DecodeGraphs.decode_step`) is written from the
engine's host lists: one ``[INPUT_ROWS, B]`` int64 array (:data:`INPUT_ROWS`) filled with numpy and copied in
once, and the block tables' used columns; rows ``n..B-1`` are padding (token 0 at position 0, a table
of the cache's scratch block, ``PagedKVCache.scratch_block``, writes into that block) and their logits are dropped. No
packed batch or step view is built for such a step, so the host work per step is a few array writes
and three copies. The graph reads nothing from the host: the batch's ``KVStepPlan`` is marked
``device_positions`` (its host starts are placeholders), the attention takes start positions from
the device tensors, RoPE's cos/sin, the staging rows and the draw's keys, temperatures and greedy
flags are derived inside the graph.

Gated DeltaNet layers (hybrid models): each row's state slot is one more input row (``SLOT``), so the
layers read and write every sequence's conv and recurrent state in place; padding rows name the slot
cache's scratch slot (``GDNSlotCache.scratch``, never a sequence's) at position 0, which the kernels
treat as a fresh sequence. The chunk form's decode step plans its chunk and chain tables on the
device from the positions and slots (``ops.gdn.triton.plan.decode_plan``); the copy on write of a
shared prompt's slot (``GDNSlotCache.prepare_append``) runs on the host before the step's inputs are
written, outside the graph. Captured only in the correctness profile with ``profile.gdn_form=chunk``
(the GPU's ``auto``): the scan form's state pass and the native ops plan each step on the host.

MoE layers (EP 1): in the correctness profile a bucket's batch is marked ``static_shapes``, so the layer routes
by a stable sort of the routing map and runs the grouped expert GEMM on a grid set by the bucket's row
count, reading each expert's row range on the device (``models.moe``); the expert batch sizes change
under the same graph. The performance profile's layer dispatches every serving step (a batch with a KV cache)
by static shapes from stock parts: Megatron's router, a device sort of the slots, torch's ``grouped_mm`` and
Megatron's ``unpermute`` (``models.moe_serving``), where Megatron's dispatcher would plan its splits on the host.
EP > 1 all-to-alls plan their splits on the host and stay eager.

Tensor parallelism (TP > 1, a TP group over NCCL): each rank captures its own graphs over its shards. The step's
cross-rank work is NCCL collectives of device tensors whose shapes follow from the bucket's row count alone: the
vocab-parallel embedding's all-gather (``parallel.embedding``), the row-parallel linears' tree all-reduce (an
all-gather of fp32 partials, ``parallel.tree_collectives``), the vocab-parallel scoring's max all-reduce and
all-gathers (``parallel.vocab_scoring.GroupComm``) and the all-gather of each vocab shard's Gumbel winner
(``inference.sampler.gumbel_tokens``). CUDA graphs record NCCL collectives, and a replay runs them; nothing crosses
ranks on the host. The ranks must replay the same bucket at the same step, and they do: every TP rank runs the engine
on the same requests and seeds, its schedule is a function of the requests alone, and every rank draws the same tokens
and logprobs from the same gathered scores, so all ranks take each step with the same rows (the same bucket) and
capture a bucket at the same step. A capture that fails on some rank leaves that rank serving the bucket eagerly: it
runs the same collectives in the same order as the ranks that replay, so the ranks stay paired. A TP group over gloo
(or any other backend) is not captured. ``tests/inference/test_decode_graphs_tp.py`` runs the TP 2 buffers eagerly on
gloo ranks (bits and host reads); ``tests/multigpu/test_decode_graphs_tp.py`` captures them over NCCL.

- Correctness profile (paged reads): the Triton kernel reads the pool through the block table, so a
  bucket is a row count. Padding is free of numerical effect because the profile is batch invariant (a
  row's bits depend on that row alone), so a replayed step gives the eager step's tokens and logprobs
  bit for bit: ``tests/inference/test_decode_graphs.py`` runs the buffers eagerly on CPU,
  ``tests/gpu/test_decode_graphs.py`` holds the captured engine to the eager one on a GPU.
- Performance profile (the native baseline): attention stages each layer's KV history, so a bucket is
  a row count and a staging length (:func:`staging_length`, at most 2x the longest sequence). Native
  kernels are not batch invariant: padding rows and masked staging columns may move its last bits, as
  any batch change does there.

Sequence parallelism (``parallel.sp``, TP > 1): a forward's rows are split evenly over the TP ranks, so every
bucket's row count is a multiple of TP (:func:`default_buckets`' ``multiple``; a bucket list that is not is
refused). Padding rows fill a step up to its bucket as always; the eager steps pad the same way
(``inference.engine``).

What stays eager: prefill steps (their shapes vary with the prompts) and steps with more rows than
the largest bucket. :func:`decode_graph_support` says which models and configs are captured.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from megatron_iso.inference import draw as draw_rows
from megatron_iso.inference.draw import Drawer, DrawPlan
from megatron_iso.inference.gdn_slots import GDNSlotCache
from megatron_iso.inference.kv_blocks import PagedKVCache, PagedStepView
from megatron_iso.inference.state import StepState
from megatron_iso.models.batch import IsoBatch, pack
from megatron_iso.models.moe_serving import build_expert_stacks, native_static_unsupported
from megatron_iso.ops.logprob import host_checked_temperature
from megatron_iso.ops.rope import check_position
from megatron_iso.registry import Profile

MIN_STAGING = 256  # tokens: the shortest staging length bucket (performance profile)
# Rows of a bucket's host-written inputs (``_Bucket.inputs``, int64): token ids, positions (a decode
# row's position is its cached length), the pool row each row writes, the draw's two key words, the
# temperature's fp32 bit pattern, the greedy flag, and the GDN state slot (models with GDN layers).
IDS, POS, WRITE, KEY0, KEY1, TEMP_BITS, GREEDY, SLOT = range(8)
INPUT_ROWS = 8
_ONE_BITS = int(np.array(1.0, dtype=np.float32).view(np.int32))  # padding rows draw greedily at temperature 1


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
        backend = tp_backend()
        if backend != "nccl":
            return (
                f"tensor_model_parallel_size={mc.tensor_model_parallel_size} over a TP group with backend "
                f"{backend!r}: CUDA graphs capture NCCL collectives only (backend 'nccl')"
            )
    if gdn_layer_indices(mc):
        if mc.iso_profile != Profile.CORRECTNESS:
            return "Gated DeltaNet layers in the performance profile: the native GDN ops plan each step on the host"
        if mc.iso_gdn_form != "chunk":
            return (
                f"Gated DeltaNet layers with profile.gdn_form={mc.iso_gdn_form!r}: only the chunk form plans a decode "
                "step on the device (the scan form's state pass runs for the sequences whose chunk closes, a count "
                "read on the host)"
            )
    if mc.num_moe_experts:
        if mc.expert_model_parallel_size > 1:
            return (
                f"expert_model_parallel_size={mc.expert_model_parallel_size}: the all-to-all splits are planned "
                "on the host (EP 1 only)"
            )
        if mc.iso_profile != Profile.CORRECTNESS:
            why = native_static_unsupported(mc)
            if why is not None:
                return f"MoE layers in the performance profile without the static dispatch: {why}"
    return None


def tp_backend() -> str | None:
    """The backend of Megatron's tensor-parallel group (``"nccl"``, ``"gloo"``, ...), None without one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not (dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    return str(dist.get_backend(parallel_state.get_tensor_model_parallel_group()))


def default_buckets(max_rows: int, multiple: int = 1) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 32, of 16 to 128, of 32 beyond, capped by (and ending at) ``max_rows``:
    padding wastes at most a few rows' work at every batch size. ``multiple``: each rounded up to a multiple of
    it (TP under sequence parallelism: ``models.batch.row_multiple``), the last one then at least ``max_rows``."""
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 32 else 16 if b < 128 else 32)
    return sorted({-(-size // multiple) * multiple for size in (*sizes, max_rows)})


def staging_length(need: int, block_size: int, width: int) -> int:
    """The staging length bucket for a step whose longest sequence holds ``need`` tokens: the next power
    of two from :data:`MIN_STAGING` on (so under 2x ``need`` past 128 tokens), in whole blocks, at most the
    table's ``width`` blocks."""
    length = max(MIN_STAGING, 1 << (max(need, 1) - 1).bit_length())
    return min(-(-length // block_size), width) * block_size


@dataclass
class _Bucket:
    rows: int
    inputs: torch.Tensor  # [INPUT_ROWS, rows] int64, written from the host once per step
    padding: np.ndarray  # the same for a step of padding rows only (the host copy each step starts from)
    ids: torch.Tensor  # [1, rows]: a view of inputs[IDS]
    batch: IsoBatch  # positions and cache_seqlens: views of inputs[POS]
    view: PagedStepView  # the bucket's device-laid-out KV view (write_idx: a view of inputs[WRITE])
    keys: torch.Tensor  # [rows, 2] int64: the draw's row keys (from inputs, inside the step)
    temp: torch.Tensor  # [rows, 1] fp32, marked host-checked (the engine checks each step's values)
    greedy: torch.Tensor  # [rows] bool
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    # The recorded draw: tokens, logprobs [rows], and both as float64 [rows, 2] (the engine's one read-back).
    drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    live: int = 0  # rows whose block-table row holds a sequence's blocks (the rest: the scratch block)


class DecodeGraphs:
    """Decode steps of the engine from static buffers per bucket, replayed from captured graphs.

    ``paged``: the attention reads the pool in place (correctness profile's Triton kernel); otherwise it
    stages each layer's history and buckets also carry a staging length. ``capture=False`` runs the same
    static buffers eagerly (no graph): how the CPU tests check the padding and the copies, and a
    fallback when a capture fails. ``multiple``: every bucket's row count divides by it (TP under sequence
    parallelism, whose forward splits the rows evenly over the TP ranks: ``models.batch.row_multiple``).
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
        gdn: GDNSlotCache | None = None,
        multiple: int = 1,
    ) -> None:
        self.model, self.kv, self.width, self.paged, self.capture = model, kv, width, paged, capture
        self.multiple = multiple
        self.gdn = gdn  # the GDN layers' slots (hybrid models): a step's rows name theirs, padding the scratch slot
        self.drawer = drawer  # records the step's Gumbel draw after the forward (None: logits only)
        self._last: tuple[_Bucket, int] | None = None
        self.buckets = sorted(buckets) if buckets else default_buckets(max_rows, multiple)
        if self.buckets[0] < 1 or any(b % multiple for b in self.buckets):
            raise ValueError(f"decode graph buckets must be >= 1 and multiples of {multiple}, got {self.buckets}")
        self.scratch = kv.scratch_block()
        self.device = next(iter(kv.k.values())).device
        self._buckets: dict[tuple[int, int | None], _Bucket] = {}
        self._pool = None
        self.steps = 0  # decode steps served from bucket buffers
        self.replays = 0  # of which replayed from a captured graph
        self.captures = 0
        self.disabled: str | None = None  # why capture stopped (a failed capture falls back to eager replays)
        self.cross_rank = model.config.tensor_model_parallel_size > 1  # the step holds NCCL collectives
        self._param_ptrs: list[int] = []

    # --- a step ---------------------------------------------------------------------------
    def serves(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` sequences runs from a bucket."""
        return rows <= self.buckets[-1]

    def decode_step(
        self,
        starts: list[int],
        tables: list[list[int]],
        ids: list[int] | torch.Tensor,
        plan: DrawPlan | None = None,
        gdn_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[n, V/tp]`` of a decode step of ``n = len(starts)`` sequences (at most the largest bucket):
        sequence i's token ``ids[i]`` (host ints, or a device tensor: a lookahead step's drawn tokens) at
        position ``starts[i]`` (its cached length), its KV blocks ``tables[i]`` (the new position's block
        included). The logits are a view of the graph's output buffer, valid until the next decode step (the
        engine samples from them before that). ``plan``: the step's draw, recorded after the forward
        (:meth:`drawn`). ``gdn_slots``: each sequence's GDN state slot, for a model with GDN layers (and only
        then); any copy on write of a shared slot has happened (the engine's ``prepare_append``)."""
        n = len(starts)
        if (gdn_slots is None) != (self.gdn is None) or (gdn_slots is not None and len(gdn_slots) != n):
            want = "no gdn_slots (the model has no GDN layers)" if self.gdn is None else f"gdn_slots for the {n} rows"
            raise ValueError(f"decode step: got gdn_slots={gdn_slots}; this engine's graphs take {want}")
        self._last = None
        bs = self.kv.block_size
        top = max(starts)
        check_position(top, where="decode step: ")
        w = max(len(t) for t in tables)
        if w > self.width:
            raise ValueError(f"decode step needs {w} blocks per sequence; graphs hold {self.width}")
        bucket = self._bucket(self._key(n, top + 1))
        host = bucket.padding.copy()
        start = np.asarray(starts, dtype=np.int64)
        table = np.zeros((n, w), dtype=np.int64)
        for r, blocks in enumerate(tables):
            table[r, : len(blocks)] = blocks
        host[POS, :n] = start
        host[WRITE, :n] = table[np.arange(n), start // bs] * bs + start % bs
        if not isinstance(ids, torch.Tensor):
            host[IDS, :n] = ids
        if gdn_slots is not None:
            host[SLOT, :n] = gdn_slots
        if plan is not None and self.drawer is not None:
            h = plan.host.numpy()
            host[KEY0, :n], host[KEY1, :n] = h[draw_rows.KEY0], h[draw_rows.KEY1]
            host[TEMP_BITS, :n] = h[draw_rows.TEMP].astype(np.float32).view(np.int32)
            host[GREEDY, :n] = h[draw_rows.GREEDY]
            self._last = (bucket, n)
        # Pageable sources: the driver stages them before the calls return, so they may go at once.
        bucket.inputs.copy_(torch.from_numpy(host), non_blocking=True)
        if isinstance(ids, torch.Tensor):
            bucket.ids[0, :n].copy_(ids.reshape(-1))
        # Columns past this step's width keep older ids: valid blocks the kernel never reads (masked keys).
        bucket.view.block_tables[:n, :w].copy_(torch.from_numpy(table), non_blocking=True)
        # A row left by a finished sequence must not keep reading blocks another sequence may now hold.
        if bucket.live > n:
            bucket.view.block_tables[n : bucket.live].fill_(self.scratch)
        bucket.live = n
        self.steps += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
        else:
            bucket.logits = self._run(bucket)
        return bucket.logits[:n]

    def drawn(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The last step's recorded draw (tokens, logprobs, and both as float64 ``[n, 2]``, of its ``n`` rows),
        if it ran from a bucket with a draw plan; valid until the next decode step."""
        if self._last is None:
            return None
        bucket, n = self._last
        return tuple(t[:n] for t in bucket.drawn)

    def warm(self, rows: int, length: int = 1) -> None:
        """Capture, now rather than at their first steps, every bucket a batch of up to ``rows`` sequences of
        up to ``length`` tokens passes through: the one serving ``rows`` and all smaller ones, which a batch
        walks down as its sequences finish. A server's start-up (or a benchmark's warm-up): capture time is
        not decode time."""
        top = self._key(min(rows, self.buckets[-1]), length)[0]
        for b in self.buckets:
            if b > top:
                break
            self._bucket(self._key(b, length))

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
            if rows % self.multiple:  # buckets set after construction
                raise ValueError(f"a decode graph bucket of {rows} rows; buckets must be multiples of {self.multiple}")
            inputs = torch.zeros((INPUT_ROWS, rows), dtype=torch.int64, device=self.device)
            tables = torch.full((rows, self.width), self.scratch, dtype=torch.int64, device=self.device)
            view = PagedStepView.on_device(
                self.kv, tables, inputs[WRITE], inputs[POS], length or self.width * self.kv.block_size
            )
            gdn = self.gdn
            _, batch = pack(
                [[0]] * rows,
                start_positions=[0] * rows,
                case="decode",
                kv_cache=StepState({PagedKVCache.kind: view}, paged=self.paged),
                slots=range(rows),
                gdn_cache=None if gdn is None else gdn.state,
                gdn_slots=None if gdn is None else [gdn.scratch] * rows,
                device=self.device,
            )
            batch.positions = batch.cache_seqlens = inputs[POS]  # the view's write-back rows read the same tensor
            batch.kv_plan.device_positions = True  # its host starts (all 0) are placeholders
            batch.static_shapes = True  # MoE layers: dispatch and expert GEMMs without host reads (models.moe)
            if gdn is not None:
                batch.gdn_slots = inputs[SLOT]  # the GDN layers read each row's state in place
            padding = np.zeros((INPUT_ROWS, rows), dtype=np.int64)
            padding[WRITE] = self.scratch * self.kv.block_size
            padding[SLOT] = 0 if gdn is None else gdn.scratch  # padding rows: position 0 (fresh) in the scratch slot
            padding[TEMP_BITS], padding[GREEDY] = _ONE_BITS, 1
            keys = torch.zeros((rows, 2), dtype=torch.int64, device=self.device)
            temp = torch.ones((rows, 1), dtype=torch.float32, device=self.device)
            host_checked_temperature(temp, torch.ones((rows, 1)))
            greedy = torch.ones(rows, dtype=torch.bool, device=self.device)
            bucket = _Bucket(rows, inputs, padding, inputs[IDS : IDS + 1], batch, view, keys, temp, greedy)
            inputs.copy_(torch.from_numpy(padding))  # every row starts as padding
            self._buckets[key] = bucket
        if bucket.graph is None and self.capture and self.disabled is None:
            # The warm-up runs must write nowhere but the scratch block.
            bucket.inputs.copy_(torch.from_numpy(bucket.padding))
            bucket.view.block_tables.fill_(self.scratch)
            bucket.live = 0
            self._capture(bucket)
        return bucket

    @torch.no_grad()
    def _run(self, bucket: _Bucket) -> torch.Tensor:
        """One step on the bucket's buffers (what a graph records): forward, then the last write-back. Without
        autograd whatever the caller's mode (:meth:`warm` is called outside the engine's ``no_grad``): the GDN
        ops refuse gradients through a state cache."""
        bucket.batch.memo.clear()  # RoPE cos/sin of the new positions
        bucket.view.discard()  # nothing left over from a warm-up or capture that raised mid-forward
        logits = self.model.forward_packed(bucket.ids, bucket.batch)
        bucket.batch.kv_cache.finish()
        if self.drawer is not None:
            inputs = bucket.inputs
            bucket.keys.copy_(inputs[KEY0 : KEY1 + 1].t())
            bucket.temp.copy_(inputs[TEMP_BITS].to(torch.int32).view(torch.float32).unsqueeze(-1))
            bucket.greedy.copy_(inputs[GREEDY] != 0)
            tokens, logprobs = self.drawer.plain(logits, bucket.keys, bucket.temp, bucket.greedy)
            bucket.drawn = (tokens, logprobs, torch.stack([tokens.double(), logprobs.double()], dim=-1))
        return logits

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up (compiles kernels, builds the bucket's host-made tables), then record one step."""
        build_expert_stacks(self.model)  # native MoE's serving copies: allocated on this stream, not the side one
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            mode = "global"
            if self.cross_rank:
                # The warm-ups' eager collectives done before the capture starts; and the process group's
                # watchdog thread may still query their events while this thread captures, which only the
                # thread-local capture mode allows (PyTorch releases whose watchdog does not switch modes itself).
                torch.cuda.synchronize(self.device)
                mode = "thread_local"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=mode):
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
