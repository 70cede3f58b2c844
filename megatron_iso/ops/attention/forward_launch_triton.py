"""The host side of a Triton attention launch: tile configs, tile tables, the schedule and the launch closures.

:func:`prepare` turns a step's host lists (token offsets, start positions, key-0 rows) into the launch(es)
of the kernels in :mod:`megatron_iso.ops.attention.forward_kernels_triton` as a closure: the tile config
(:func:`_config`: :data:`CONFIGS`, :data:`DECODE_CONFIGS` and their wide-head twins), the tile table
(:func:`_plan`) and the schedule (:func:`split_schedule`: one launch, or split over key segments). None of
them moves a bit (docs/KERNELS.md, "Attention forward kernels": the numerical policy and why); the configs and
:data:`SEG_BLOCKS` are contract constants all the same (``attention_triton._constants``). A config's ``park``
(the one launch's running accumulator in fp32 scratch between merges, not registers) is the bf16/fp16 training
tile's; the split schedule never parks (its segment programs hold one accumulator).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import triton

from megatron_iso.ops.attention.forward_kernels_triton import _attend_kernel, _combine_kernel, _segments_kernel
from megatron_iso.ops.common.interpret import INTERPRET as _INTERPRET
from megatron_iso.ops.common.sm_count import sm_count

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionTileConfig:
    """Everything that fixes a row's instruction sequence besides kv_block (keyed into the contract)."""

    block_m: int  # rows (token x group head) per program
    num_warps: int
    num_stages: int
    # One launch only: park the running accumulator in an fp32 scratch tile per program between segment merges
    # instead of holding it in registers through the key loop (forward_kernels_triton._walk). The same
    # bits; fewer registers live in the loop, an fp32 tile stored and reloaded (hot in L2) per segment.
    park: bool = False
    # A register cap for ptxas (PTX .maxnreg), None for its own choice. For fp32 the kernels' dots are long FMA
    # sequences, and ptxas's own choice for them is 32 registers with kilobytes of spills; a cap well above that
    # frees it. Register allocation only: the same instructions, so the same bits.
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.park, bool):
            raise ValueError(f"AttentionTileConfig: park={self.park!r} must be a bool (True or False)")
        if self.maxnreg is not None and (
            not isinstance(self.maxnreg, int) or isinstance(self.maxnreg, bool) or not 24 <= self.maxnreg <= 255
        ):
            raise ValueError(f"AttentionTileConfig: maxnreg={self.maxnreg!r} must be None or an int in [24, 255]")

    def launch_options(self) -> dict[str, int]:
        """Triton launch options besides warps and stages: the register cap when set."""
        return {} if self.maxnreg is None else {"maxnreg": self.maxnreg}


# Per input dtype and head width, and whether the launch is a decode step (one new token per sequence):
# never chosen from the batch size. The tile config moves no bit (forward_kernels_triton), so decode takes
# 16-row tiles (a GQA group's 2-8 live rows, not 128 of which 2 are live) and many more programs.
# bf16/fp16 training and prefill park the running accumulator (two fp32 64 x 128 accumulators in registers spill
# at 4 warps; 8 warps per 64 rows run slower still); at 2 stages a parked program takes 112 KB of shared memory, so
# two fit an SM. tools/bench_ops.py --attention times the unparked tiles beside it.
# fp32 runs its dots as FMA loops (the exact ieee dot) and caps ptxas's registers: left to itself ptxas gives the
# kernel 32 registers and spills (64 x 4 x 2: a 14.7 KB stack, 14,794 local-memory operations in loops); 32 rows,
# 8 warps under a 168 cap: 872 B, 423; decode's 16 x 4 x 2: 5.4 KB -> 832 B (tools/kernel_resources.py, sm_90).
CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=64, num_warps=4, num_stages=2, park=True),
    torch.float16: AttentionTileConfig(block_m=64, num_warps=4, num_stages=2, park=True),
    torch.float32: AttentionTileConfig(block_m=32, num_warps=8, num_stages=2, maxnreg=168),
}
DECODE_CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=3),
    torch.float16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=3),
    torch.float32: AttentionTileConfig(block_m=16, num_warps=4, num_stages=2, maxnreg=168),
}
# Heads wider than 128 (Qwen3.5 / Qwen3-Next attention: 256). The tiles above need 256 KB of shared
# memory at head dim 256 (an H200 has 227 KB per block), so fewer rows and stages. fp32 at head dim 256 under a
# 255-register cap: 16 x 8 x 1 keeps a 2.0 KB stack where 32 x 4 x 1 uncapped had 15.0 KB (decode 16 x 4 x 1: 12.0).
WIDE_HEAD_DIM = 128
MAX_HEAD_DIM = 256
WIDE_CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=64, num_warps=8, num_stages=2),
    torch.float16: AttentionTileConfig(block_m=64, num_warps=8, num_stages=2),
    torch.float32: AttentionTileConfig(block_m=16, num_warps=8, num_stages=1, maxnreg=255),
}
WIDE_DECODE_CONFIGS: dict[torch.dtype, AttentionTileConfig] = {
    torch.bfloat16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=2),
    torch.float16: AttentionTileConfig(block_m=16, num_warps=4, num_stages=2),
    torch.float32: AttentionTileConfig(block_m=16, num_warps=8, num_stages=1, maxnreg=255),
}
INTERPRET_CONFIG = AttentionTileConfig(block_m=16, num_warps=4, num_stages=1)
# Key blocks per segment: softmax state restarts at each segment and segments merge in ascending order
# (forward_kernels_triton). Part of the arithmetic (contract constants), so training and decode use the same.
SEG_BLOCKS = 2
# The auto schedule splits only while the fp32 scratch (rows x capacity segments x (head dim + 2)) stays below
# this: e.g. 16 rows of Qwen3-0.6B at a 32k-key capacity take 34 MB, 32 rows of Qwen3-30B-A3B 136 MB.
SPLIT_SCRATCH_BYTES = 64 << 20
MAX_KV_BLOCK = 512  # the widest key block the kernel is tuned and tested for (the row-sum tree allows 1024)


def _config(
    dtype: torch.dtype, head_dim: int, config: AttentionTileConfig | None, decode: bool = False
) -> AttentionTileConfig:
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"attention_triton: head dim {head_dim} is not supported (at most {MAX_HEAD_DIM})")
    if config is not None:
        return config
    if _INTERPRET:
        return INTERPRET_CONFIG
    if head_dim > WIDE_HEAD_DIM:
        return (WIDE_DECODE_CONFIGS if decode else WIDE_CONFIGS)[dtype]
    return (DECODE_CONFIGS if decode else CONFIGS)[dtype]


def _plan(lens: list[int], group: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile table (sequence, first row): a schedule, never arithmetic. Later (longer) tiles go first.

    A pure-decode step (one row per sequence) has the table of its batch size: built once per
    (batch, group, block_m, device) and shared by every such step (no host sort, no copy per step;
    a fixed device tensor, as a captured CUDA graph needs). The kernel only reads it.
    """
    if all(n == 1 for n in lens):
        return _decode_plan(len(lens), group, block_m, device)
    return _build_plan(lens, group, block_m, device)


@functools.cache  # never evicted: a captured decode graph reads the table by address (one per batch size)
def _decode_plan(n: int, group: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _build_plan([1] * n, group, block_m, device)


def _build_plan(lens: list[int], group: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    seqs: list[int] = []
    rows: list[int] = []
    for i, n in enumerate(lens):
        for r in range(0, n * group, block_m):
            seqs.append(i)
            rows.append(r)
    order = sorted(range(len(seqs)), key=lambda t: -rows[t])
    tab = torch.tensor([[seqs[t] for t in order], [rows[t] for t in order]], dtype=torch.int32)
    tab = tab.to(device, non_blocking=True)
    return tab[0], tab[1]


def _tables(
    cu: list[int], starts: list[int], kv_offsets: list[int], group: int, block_m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch's device-side inputs: tile table (sequence, first row) and the [3, n+1] table of
    token offsets, start positions and key-0 rows."""
    tile_seq, tile_row = _plan([b - a for a, b in pairwise(cu)], group, block_m, device)
    meta = torch.tensor([cu, [*starts, 0], [*kv_offsets, 0]], dtype=torch.int64).to(device, non_blocking=True)
    return tile_seq, tile_row, meta


def split_schedule(
    programs: int, segments: int, decode: bool, sm_count: int, split: bool | None = None, scratch_bytes: int = 0
) -> int:
    """Programs per (tile, kv head) over key segments: 0 = one launch (each program walks all its segments),
    else the split launch with that many segment programs. A schedule choice, never an arithmetic one.

    ``split`` None: split a decode step whose ``programs`` (tiles x kv heads) fill at most a quarter of the
    SMs, whose key capacity spans more than one segment and whose ``scratch_bytes`` fit
    :data:`SPLIT_SCRATCH_BYTES`; True / False force it. (At batch 16 with 8 kv heads, 128 programs on 132 SMs,
    the split measured slower than one launch: 23.6 against 18.3 us at 640 keys; at batch 1, 9.6 against 17.2.) A split takes about two waves of segment programs. ``segments`` is the static maximum
    (the capacity's), so the grid is the same at every step of a captured decode graph.
    """
    if split is None:
        split = decode and segments > 1 and 4 * programs <= sm_count and scratch_bytes <= SPLIT_SCRATCH_BYTES
    return min(segments, triton.cdiv(2 * sm_count, programs)) if split else 0


def prepare(
    q: torch.Tensor,
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    gate: torch.Tensor | None,
    cu: list[int],
    starts: list[int],
    kv_offsets: list[int],
    scale: float,
    kv_block: int,
    config: AttentionTileConfig | None,
    tables: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    *,
    block_tables: torch.Tensor | None = None,
    page: int = 0,
    seq_meta: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_capacity: int | None = None,
    split: bool | None = None,
    seg_blocks: int = SEG_BLOCKS,
    segment_programs: int | None = None,
) -> tuple[Callable[[], object], torch.Tensor]:
    """The kernel launch(es) as a closure (host planning done) and the output tensor; the benchmark times the closure.

    k_src/v_src ``[rows, Hkv, D]`` (packed tokens or a flattened cache); key 0 of sequence i is row kv_offsets[i].
    Paged (``page`` > 0): k_src/v_src are a flattened pool of ``page``-token blocks, ``block_tables`` a
    contiguous ``[rows, width]`` int tensor of block ids, and kv_offsets[i] the element offset of
    sequence i's table row in it (:func:`attention_with_paged_kv_cache`).
    ``tables(group, block_m)``: the :func:`_tables` of these lists, from a cache shared by a step's
    layers (the same values, so the same launch); without it they are built here.
    ``seq_meta``: device ``(cu_seqlens, start positions)`` the kernel reads instead of the host-built
    rows of ``tables``' metadata (the same values): a captured decode graph replays with new
    positions written into those tensors, so they cannot be baked into a table built at capture.
    ``kv_capacity``: the most keys any sequence can have (default: the host lists' longest), which sizes
    the split schedule's segment axis and scratch; static where the host starts are placeholders.
    ``split``: None = :func:`split_schedule`; True / False force the split / one-launch schedule (same
    bits). ``segment_programs``: the split's programs per (tile, kv head), for tests and benchmarks.
    ``seg_blocks``: key blocks per segment, part of the arithmetic (:data:`SEG_BLOCKS` in the contract;
    another value is for tuning experiments only).
    """
    T, hq, dim = q.shape
    hkv = k_src.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    lens = [b - a for a, b in pairwise(cu)]
    if T == 0 or not any(lens):
        return (lambda: None), out
    decode = max(lens) == 1
    cfg = _config(q.dtype, dim, config, decode=decode)
    if kv_block < 16 or kv_block > MAX_KV_BLOCK or kv_block & (kv_block - 1):
        raise ValueError(f"attention_triton: kv_block={kv_block} must be a power of two in [16, {MAX_KV_BLOCK}]")
    if not isinstance(seg_blocks, int) or seg_blocks < 1:
        raise ValueError(f"attention_triton: seg_blocks={seg_blocks!r} must be a positive int (kv blocks per segment)")
    if k_src.stride(-1) != 1 or v_src.stride() != k_src.stride() or q.stride(-1) != 1:
        raise ValueError("attention_triton: q/k/v (or the cache) need a contiguous last dim and equal k/v strides")
    longest = max(s + n for s, n in zip(starts, lens, strict=True))
    if kv_capacity is None:
        kv_capacity = longest
    elif kv_capacity < longest:
        raise ValueError(f"attention_triton: kv_capacity={kv_capacity} is below a sequence's {longest} keys")
    if tables is None:
        tile_seq, tile_row, meta = _tables(cu, starts, kv_offsets, group, cfg.block_m, q.device)
    else:
        tile_seq, tile_row, meta = tables(group, cfg.block_m)
    if (page > 0) != (block_tables is not None):
        raise ValueError(f"attention_triton: page={page} and block_tables go together (page > 0 with a table)")
    gated = gate is not None
    g = gate if gated else q
    if gated and gate.stride(-1) != 1:
        g = gate.contiguous()
    n_tiles = tile_seq.numel()
    seg_max = triton.cdiv(kv_capacity, seg_blocks * kv_block)
    if segment_programs is not None:
        if split is False or not 1 <= segment_programs <= seg_max:
            raise ValueError(
                f"attention_triton: segment_programs={segment_programs} needs split and 1..{seg_max} (segments)"
            )
        progs = segment_programs
    else:
        scratch = T * hq * seg_max * (dim + 2) * 4
        progs = split_schedule(n_tiles * hkv, seg_max, decode, sm_count(q.device), split, scratch)
    tile_args = (tile_seq, tile_row, *(meta[:2] if seq_meta is None else seq_meta), meta[2])
    bt = meta[2] if block_tables is None else block_tables
    shape = dict(
        GROUP=group, D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=cfg.block_m, BLOCK_N=kv_block,
        SEG_BLOCKS=seg_blocks, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    numerics = dict(
        P_LOWP=q.dtype != torch.float32 and not _INTERPRET, IEEE=q.dtype == torch.float32,
        CAST_F32=_INTERPRET and q.dtype != torch.float32, PAGE=page,
    )  # fmt: skip
    gating = dict(GATED=gated, GATE_PER_DIM=gated and gate.shape[-1] != 1)
    qk_scale = float(scale) * _LOG2E
    if not progs:
        # A parked config's fp32 scratch: one [BLOCK_M, BLOCK_D] tile per program, read only by that program
        # (allocated per launch: under a CUDA graph capture it lives in the graph's pool). Else never read.
        park = out
        if cfg.park:
            park = torch.empty(n_tiles * hkv * cfg.block_m * shape["BLOCK_D"], device=q.device, dtype=torch.float32)
        return functools.partial(
            _attend_kernel[(n_tiles, hkv)],
            q, k_src, v_src, g, out, park, *tile_args, bt,
            q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1), g.stride(0), g.stride(1),
            out.stride(0), out.stride(1), qk_scale, **shape, **numerics, **gating, PARK=cfg.park, SYNC=not _INTERPRET,
            **cfg.launch_options(),
        ), out  # fmt: skip
    # fp32 scratch: each (token, query head) row's (m, l, acc) per segment; a segment no program reaches is
    # never read (the combine walks the tile's segments up to its last position only).
    seg_m = torch.empty(T * hq, seg_max, device=q.device, dtype=torch.float32)
    seg_l = torch.empty_like(seg_m)
    seg_acc = torch.empty(T * hq, seg_max, dim, device=q.device, dtype=torch.float32)
    segments = functools.partial(
        _segments_kernel[(n_tiles, hkv, progs)],
        q, k_src, v_src, seg_m, seg_l, seg_acc, *tile_args, bt,
        q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1), qk_scale, hq, seg_max, **shape, **numerics,
        **cfg.launch_options(),
    )  # fmt: skip
    combine = functools.partial(
        _combine_kernel[(n_tiles, hkv)],
        g, out, seg_m, seg_l, seg_acc, *tile_args,
        g.stride(0), g.stride(1), out.stride(0), out.stride(1), hq, seg_max, **shape, **gating,
    )  # fmt: skip

    def call() -> None:
        segments()
        combine()

    return call, out


__all__ = [
    "CONFIGS",
    "DECODE_CONFIGS",
    "SEG_BLOCKS",
    "AttentionTileConfig",
    "prepare",
    "split_schedule",
]
