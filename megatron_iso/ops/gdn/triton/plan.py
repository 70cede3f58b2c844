"""A call's plan: which packed rows form which segment (scan form), chunk and chain, as int32 tables the kernels read,
built on the host from the sequence boundaries and cached across the layers of a forward (:func:`cached_plan`), or, for
a chunk-form decode step, on the device from the start positions and slots alone (:func:`decode_plan`: no host read, so
a CUDA graph can record it).

The host copy of the boundaries is cached apart from the plans: a training call's backward plans the same rows in the
chunk form after a scan-form forward (``rule._RuleFunction``), and takes them from the forward's read, so one training
micro-batch reads its layout once for all its GDN layers, forward and backward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_iso.ops.common.tensor_keyed_cache import TensorKeyedCache
from megatron_iso.ops.gdn.checks import check_nonempty, check_starts, check_state_slots
from megatron_iso.ops.gdn.triton import tuning


@dataclass
class Plan:
    n: int
    nseg: int
    nchunks: int
    seg: torch.Tensor  # [nseg, 8] int32 (device; columns: _scan_kernel's docstring; scan form)
    chunks: torch.Tensor  # [nchunks, CHUNK_COLS] int32 (_prep_kernel's docstring)
    chains: torch.Tensor  # [nchains, 6] int32 (_chain_kernel's docstring)
    nchains: int
    scratch: bool  # finals go to a scratch tensor (some sequence has several segments; scan form)
    buffers: bool  # some chunk's tokens go to the state cache's buffer (chunk form: _buffer_kernel runs)


# A call's plan, shared by the GDN layers of a forward (same layout tensors, chunk, state, device, slot count).
_PLAN_CACHE: TensorKeyedCache[Plan] = TensorKeyedCache(4)
# The host lists of the layout tensors, shared by the plans of every form built from them (forward and backward).
_HOST_LISTS: TensorKeyedCache[tuple[list[int], list[int], list[int] | None]] = TensorKeyedCache(4)


def _host_lists(cu: torch.Tensor, starts: torch.Tensor | None, slots: torch.Tensor | None):
    parts = [cu.reshape(-1).to(torch.int64)]
    for t in (starts, slots):
        if t is not None:
            parts.append(t.reshape(-1).to(device=cu.device, dtype=torch.int64))
    flat = torch.cat(parts).tolist()  # the one device->host copy of a call (cached across layers)
    n = cu.numel() - 1
    cu_l = flat[: n + 1]
    rest = flat[n + 1 :]
    st = [0] * n
    if starts is not None:
        st, rest = rest[:n], rest[n:]
    sl = rest[:n] if slots is not None else None
    return cu_l, st, sl


def cached_plan(cu, starts, slots, chunk, has_state, dev, slot_count, form, carry: bool = False) -> Plan:
    """:func:`_plan`, shared by the layers of a forward; the slot count is part of the key because the plan's bounds
    check depends on it."""
    extra = (chunk, has_state, dev, slot_count, form, carry)
    return _PLAN_CACHE.get((cu, starts, slots), extra, lambda: _plan(cu, starts, slots, *extra))


# Decode plans, shared by the GDN layers of a forward. The key holds whether the stream was capturing a CUDA graph: a
# plan built by a warm-up run must not stand in for the capture's own, whose ops the graph has to record.
_DECODE_PLANS: TensorKeyedCache[Plan] = TensorKeyedCache(4)


def decode_plan(
    cu: torch.Tensor, starts: torch.Tensor | None, slots: torch.Tensor, chunk: int, dev: torch.device, slot_count: int
) -> Plan:
    """:func:`_plan`'s tables for a chunk-form call of one token per sequence with a state cache (a decode step: as
    many rows as sequences), built from the device tensors ``starts`` (None: all 0) and ``slots`` ``[n]`` by device
    ops, so that a CUDA graph records them: sequence i's token is packed row i and nothing else varies. Outside a
    capture the call is also checked as :func:`_plan` checks it (boundaries, starts, slot range: one read back, as a
    host plan's); inside one nothing is read, and the caller's values must be valid (the engine's are). Shared by the
    layers of a forward."""
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    extra = (chunk, dev, slot_count, capturing)
    return _DECODE_PLANS.get(
        (cu, starts, slots), extra, lambda: _decode_plan(cu, starts, slots, chunk, dev, slot_count, not capturing)
    )


def _decode_plan(
    cu: torch.Tensor,
    starts: torch.Tensor | None,
    slots: torch.Tensor,
    chunk: int,
    dev: torch.device,
    slot_count: int,
    check: bool,
) -> Plan:
    n = cu.numel() - 1
    if check:
        cu_l, st_l, sl = _host_lists(cu, starts, slots)
        if cu_l != list(range(n + 1)):
            raise ValueError(f"gated_delta_rule: a decode step has one token per sequence; cu_seqlens={cu_l}")
        check_starts(st_l, n)
        if any(not 0 <= s < slot_count for s in sl):
            raise ValueError(f"gated_delta_rule: slots {sl} outside the state cache's {slot_count} slots")
    row = torch.arange(n, device=dev, dtype=torch.int64)
    st = torch.zeros_like(row) if starts is None else starts.reshape(-1).to(device=dev, dtype=torch.int64)
    sl = slots.reshape(-1).to(device=dev, dtype=torch.int64)
    o = st % chunk  # the token's place in its chunk = the tokens buffered before it
    closes = o == chunk - 1
    opened, warm = (~closes).long(), (st > 0).long()
    # chunk rows: (packed row of the chunk's token 0, buffered, buffer row base, present, left open)
    chunks = torch.stack([row - o, o, sl * chunk, o + 1, opened], 1)
    # chain rows: (first chunk, count, entry kind, slot, write back, last chunk open)
    chains = torch.stack([row, torch.ones_like(row), warm, sl, (closes | (st == 0)).long(), opened], 1)
    return Plan(
        n=n,
        nseg=0,
        nchunks=n,
        seg=torch.zeros(1, 8, dtype=torch.int32, device=dev),  # the scan form's segments: a decode step reads none
        chunks=chunks.to(torch.int32),
        chains=chains.to(torch.int32),
        nchains=n,
        scratch=False,
        buffers=True,  # unread: a decode step's prep kernel buffers each token whose chunk stays open (chunk flag)
    )


def _plan(
    cu: torch.Tensor,
    starts: torch.Tensor | None,
    slots: torch.Tensor | None,
    chunk: int,
    has_state: bool,
    dev: torch.device,
    slot_count: int,
    form: str = tuning.FORM,
    carry: bool = False,
) -> Plan:
    """Segments (with the buffer rows of a chunk left open), chunks and chains of a call, as int32 tables on ``dev``.
    Scan form: the chunk table holds the chunks the call closes (the state pass); chunk form: every chunk the call
    has tokens in, open ones included (each gets output tiles).

    ``carry`` (no state cache; ``.carry``): sequence i enters from row i of a given entry tensor (chain entry kind 1,
    scan start kind 1, both from row i) and its chain writes the state at its last chunk boundary back to that row
    (the exit); a sequence with no chunk to close has no chain (its exit is its entry). Nothing is buffered."""
    if carry and (has_state or starts is not None or slots is not None):
        raise ValueError("gated_delta_rule: a carried call takes no state cache, starts or slots")
    cu_l, st, sl = _HOST_LISTS.get((cu, starts, slots), (), lambda: _host_lists(cu, starts, slots))
    n = len(cu_l) - 1
    check_nonempty(cu_l)
    if has_state and sl is not None and any(not 0 <= s < slot_count for s in sl):
        raise ValueError(f"gated_delta_rule: slots {sl} outside the state cache's {slot_count} slots")
    check_starts(st, n)
    check_state_slots(has_state, sl, n, st)
    segs, chunks, chains = [], [], []
    fin_rows = []
    multi = False
    for i in range(n):
        a, pos, end = cu_l[i], st[i], cu_l[i + 1]
        slot = sl[i] if has_state else i if carry else 0
        first_chunk = len(chunks)
        prev_chunk = -1
        mine = []
        while a < end:
            o = pos % chunk
            b = min(end, a + chunk - o)
            closes = o + b - a == chunk
            # scan start: the running state (or zeros) for the call's first segment, else the exit state
            # of the chunk the previous segment closed
            init = (2, prev_chunk) if prev_chunk >= 0 else (1, slot) if pos > 0 or carry else (0, 0)
            cidx = -1
            if closes or form == "chunk":
                cidx = len(chunks)
                chunks.append((a - o, o, slot * chunk, o + b - a, int(has_state and not closes)))
            # columns 0-6 and 10 go to the table (_scan_kernel's seg row); 7-9 are planning notes
            mine.append([a, b - a, init[0], init[1], -1, 0, 0, closes, cidx, o, -1])
            prev_chunk = cidx
            pos += b - a
            a = b
        if len(mine) > 1:
            multi = True
        nc = len(chunks) - first_chunk
        last_open = int(form == "chunk" and not mine[-1][7])
        if carry and nc:  # entry row i; the exit written back unless the only chunk stays open
            chains.append((first_chunk, nc, 1, slot, int(nc > last_open), last_open))
        elif nc or (has_state and st[i] == 0):
            # write back: the open chunk's entry state for the next call (unchanged if no chunk closed and the
            # sequence did not start here)
            wb = has_state and (nc > last_open or st[i] == 0)
            chains.append((first_chunk, nc, 1 if st[i] > 0 else 0, slot, int(wb), last_open))
        if has_state:
            last = mine[-1]
            last[4] = i  # placeholder: becomes the slot (direct) or i (scratch) below
            last[5], last[6] = (1, last[8]) if last[7] else (0, 0)
            fin_rows.append(last)
            if not last[7]:  # the call leaves this chunk open: the scan copies its tokens into the buffer
                last[10] = slot * chunk + last[9]
        segs += mine
    for i, last in enumerate(fin_rows):
        last[4] = i if multi else sl[i]

    def tab(rows, cols):
        flat = [int(r[c]) for r in rows for c in cols]
        return torch.tensor(flat or [0] * len(cols), dtype=torch.int32).reshape(-1, len(cols)).to(dev)

    return Plan(
        n=n,
        nseg=len(segs),
        nchunks=len(chunks),
        seg=tab(segs, (0, 1, 2, 3, 4, 5, 6, 10)),
        chunks=tab(chunks, range(tuning.CHUNK_COLS)),
        chains=tab(chains, range(6)),
        nchains=len(chains),
        scratch=multi,
        buffers=any(c[4] for c in chunks),
    )
