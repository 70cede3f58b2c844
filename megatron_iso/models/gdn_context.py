"""Gated DeltaNet under context parallelism: each CP rank runs its own rows and the state passes rank to rank.

The zigzag split (``parallel.context``) gives CP rank ``r`` of ``N`` the packed chunks ``r`` and ``2N - 1 - r``. In
sequence order the chunks form one chain, chunk 0 (rank 0) -> chunk 1 (rank 1) -> ... -> chunk N-1 (rank N-1) ->
chunk N (rank N-1, the same rank) -> ... -> chunk 2N-1 (rank 0); a chunk boundary that falls inside a sequence is a
link of the chain, one message from the chunk before it to the chunk after it (none where a sequence starts exactly
at the boundary: both sides read that from the pack's host bounds).

What crosses a link, and why (design): the delta rule works in chunks of ``profile.gdn_chunk`` rows counted from
each sequence's first token (CPR, docs/GDN.md), and a CP boundary generally falls inside one of them. The sending
chunk passes the state at the sequence's last GDN chunk boundary before the CP boundary (``exit`` of
``ops.gdn.gated_delta_rule_carry``, fp32 ``[Hv, Dk, Dv]``) together with a halo: the raw conv/gate inputs
(``[q | k | v | b | a]``, before the conv) of the rows from that GDN chunk boundary to the CP boundary (fewer than
``gdn_chunk``) plus the ``kernel - 1`` rows before them (the conv's history). The receiver puts the halo before its
own rows, recomputes conv, l2norm and gates on it, and runs the rule from that GDN chunk boundary with the received
state: the chunk containing the CP boundary is state-passed and scanned from its first row by one call, exactly the
arithmetic of CP 1, so every row's output has CP 1's bits (tests/parallel/test_context_parallel_gdn.py). The halo
rows' own outputs are the sender's and are dropped. A halo can reach back past the sender's chunk (a CP chunk shorter
than ``gdn_chunk + kernel - 2`` rows): the sender's extended rows (its received halo, then its rows) hold it, so the
halo moves on down the chain. Not chosen: padding the pack so CP boundaries fall on GDN chunk boundaries, which only
works for one sequence per pack (the others' chunk grids start elsewhere) and changes the row count the rest of the
model sees.

The backward runs the same chain in reverse (the gradient of a chunk's outgoing state and halo from the later chunk
to the earlier one), inside one ``autograd.Function`` per layer call: its forward keeps each local chunk's graph
(built under ``enable_grad`` on detached leaves, so the graph holds only this rank's rows and halos) and its backward
walks the chunks in reverse sequence order with explicit send/recv, so autograd's scheduling cannot reorder the
point-to-point calls. A halo row's gradient returns to the rank that owns the row. Parameter gradients are this
rank's part of the sum over ranks (deterministic, not bitwise CP 1's, as attention's dK/dV).

The chain is sequential: rank ``r + 1`` starts its early chunk when rank ``r``'s state arrives, so the layer's time
is about CP 1's; what CP buys here is memory (activations of ``T / CP`` rows plus halos) and no whole-pack gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_iso.ops.gdn import gated_delta_rule_carry
from megatron_iso.parallel.context import ContextShard, recv_from, send_to


@dataclass(frozen=True)
class Link:
    """A CP chunk boundary a sequence crosses: ``boundary`` (the packed row starting the later chunk), ``rule_start``
    (the sequence's last GDN chunk boundary at or before it) and ``halo_start`` (``kernel - 1`` rows earlier, not
    before the sequence's first row): the halo is the packed rows ``[halo_start, boundary)``."""

    boundary: int
    rule_start: int
    halo_start: int


@dataclass(frozen=True)
class ChunkWork:
    """One local CP chunk: packed rows ``[lo, hi)``, local rows from ``local``; the link into it (from CP rank
    ``prev_peer``, None: this rank) and out of it (to ``next_peer``); the sequence pieces of its extended rows
    ``[ext_lo, hi)`` (``conv_cu``) and of the rows the rule runs, ``[rule_lo, hi)`` (``rule_cu``), relative."""

    lo: int
    hi: int
    local: int
    incoming: Link | None
    prev_peer: int | None
    outgoing: Link | None
    next_peer: int | None
    conv_cu: tuple[int, ...]
    rule_cu: tuple[int, ...]

    @property
    def rows(self) -> slice:
        """This chunk's rows among the rank's local rows."""
        return slice(self.local, self.local + self.hi - self.lo)

    @property
    def ext_lo(self) -> int:
        return self.incoming.halo_start if self.incoming else self.lo

    @property
    def rule_lo(self) -> int:
        return self.incoming.rule_start if self.incoming else self.lo


def _link(bounds: tuple[int, ...], boundary: int, chunk: int, kernel: int) -> Link | None:
    """The link at packed row ``boundary``, None where no sequence crosses it (one starts there)."""
    start = max(a for a in bounds[:-1] if a <= boundary)
    if start == boundary:
        return None
    rule_start = boundary - (boundary - start) % chunk
    return Link(boundary, rule_start, max(start, rule_start - (kernel - 1)))


def _pieces(bounds: tuple[int, ...], lo: int, hi: int) -> tuple[int, ...]:
    """cu_seqlens of rows ``[lo, hi)`` (one piece per sequence they touch), relative to ``lo``."""
    return (0, *(a - lo for a in bounds if lo < a < hi), hi - lo)


def chain_plan(bounds: tuple[int, ...], size: int, rank: int, chunk: int, kernel: int) -> tuple[ChunkWork, ChunkWork]:
    """CP rank ``rank``'s two chunks (early, late: their sequence order) of a padded pack with cu_seqlens ``bounds``
    (host ints), for GDN chunk ``chunk`` and conv kernel ``kernel``."""
    rows = bounds[-1] // (2 * size)

    def owner(c: int) -> int:
        return c if c < size else 2 * size - 1 - c

    works = []
    for local, c in enumerate((rank, 2 * size - 1 - rank)):
        lo, hi = c * rows, (c + 1) * rows
        incoming = _link(bounds, lo, chunk, kernel) if c > 0 else None
        outgoing = _link(bounds, hi, chunk, kernel) if c < 2 * size - 1 else None
        prev_peer = None if c == 0 or owner(c - 1) == rank else owner(c - 1)
        next_peer = None if c == 2 * size - 1 or owner(c + 1) == rank else owner(c + 1)
        ext_lo = incoming.halo_start if incoming else lo
        rule_lo = incoming.rule_start if incoming else lo
        works.append(ChunkWork(lo, hi, local * rows, incoming, prev_peer, outgoing, next_peer,
                               _pieces(bounds, ext_lo, hi), _pieces(bounds, rule_lo, hi)))  # fmt: skip
    return works[0], works[1]


@dataclass
class _Run:
    """One chunk's forward: the leaves it received (halo rows, entry state) and what it produced (its rows' outputs,
    the outgoing state and halo)."""

    halo_in: torch.Tensor | None = None
    entry_in: torch.Tensor | None = None
    out: torch.Tensor | None = None
    exit_out: torch.Tensor | None = None
    halo_out: torch.Tensor | None = None


def _device_cu(shard: ContextShard, cu: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``cu`` as an int32 tensor on ``device``, one per shard: every GDN layer of the pack reuses it (no copy per layer,
    and the Triton rule's plan, keyed by the tensor, is made once)."""
    return shard.memo(("gdn_chain_cu", cu, device), lambda: torch.tensor(cu, dtype=torch.int32, device=device))


def _chunk_forward(layer, x: torch.Tensor, params, work: ChunkWork, run: _Run, shard: ContextShard) -> None:
    """Conv, gates and the carried rule over one chunk's extended rows (the received halo, then ``x``, its rows)."""
    ext = x if run.halo_in is None else torch.cat([run.halo_in, x])
    qkv, b, a = torch.split(ext, [layer.conv_dim, layer.hv, layer.hv], dim=-1)
    conv_cu = _device_cu(shard, work.conv_cu, x.device)
    feats = layer.features(qkv, b, a, conv_cu, params)
    skip = work.rule_lo - work.ext_lo  # conv history rows: inputs of the halo, not rows the rule runs
    q, k, v, g, beta = (f[skip:] for f in feats)
    n = len(work.rule_cu) - 1
    zeros = torch.zeros(
        n - (run.entry_in is not None), layer.hv, layer.dk, layer.dv, dtype=torch.float32, device=x.device
    )
    entry = zeros if run.entry_in is None else torch.cat([run.entry_in[None], zeros])
    rule_cu = _device_cu(shard, work.rule_cu, x.device)
    out, exits = gated_delta_rule_carry(q, k, v, g, beta, rule_cu, entry, **layer.rule_options())
    run.out = out[work.lo - work.rule_lo :]
    if work.outgoing is not None:
        run.exit_out = exits[-1]
        run.halo_out = ext[work.outgoing.halo_start - work.ext_lo :]


def _message_like(layer, x: torch.Tensor, link: Link) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of a link's message (and of its gradient): the state, then the halo rows."""
    return [((layer.hv, layer.dk, layer.dv), torch.float32), ((link.boundary - link.halo_start, x.shape[1]), x.dtype)]


def _forward_chain(layer, x: torch.Tensor, params, shard: ContextShard, works, leaves: bool) -> list[_Run]:
    """Both local chunks in sequence order, receiving before and sending after each; ``leaves``: received tensors
    become leaves that require grad (the backward's graph)."""
    runs, handoff = [], None
    for work in works:
        run = _Run()
        if work.incoming is not None:
            if work.prev_peer is None:
                msg = [t.detach() for t in handoff]  # the middle link: this rank's early chunk to its late one
            else:
                msg = recv_from(_message_like(layer, x, work.incoming), shard, work.prev_peer, x.device)
            run.entry_in, run.halo_in = (t.requires_grad_(leaves) for t in msg)
        _chunk_forward(layer, x[work.rows], params, work, run, shard)
        if work.outgoing is not None:
            msg = [run.exit_out.detach(), run.halo_out.detach()]
            if work.next_peer is None:
                handoff = msg
            else:
                send_to(msg, shard, work.next_peer)
        runs.append(run)
    return runs


class _StateChain(torch.autograd.Function):
    """Forward: :func:`_forward_chain` with graphs kept. Backward: the chunks in reverse sequence order, each
    receiving its outgoing link's gradient, back-propagating its graph and sending its incoming link's gradient."""

    @staticmethod
    def forward(ctx, x, weight, A_log, dt_bias, layer, shard, works):  # type: ignore[override]
        xs = x.detach().requires_grad_(x.requires_grad)
        params = tuple(p.detach().requires_grad_(p.requires_grad) for p in (weight, A_log, dt_bias))
        with torch.enable_grad():
            runs = _forward_chain(layer, xs, params, shard, works, leaves=True)
        ctx.state = (xs, params, layer, shard, works, runs)
        return torch.cat([r.out.detach() for r in runs])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        xs, params, layer, shard, works, runs = ctx.state
        del ctx.state
        inputs = [t for t in (xs, *params) if t.requires_grad]
        total: list[torch.Tensor | None] = [None] * len(inputs)
        handoff = None
        for work, run in reversed(list(zip(works, runs, strict=True))):
            outs, grads = [run.out], [grad[work.rows]]
            if work.outgoing is not None:
                if work.next_peer is None:
                    msg = handoff
                else:
                    msg = recv_from(_message_like(layer, xs, work.outgoing), shard, work.next_peer, grad.device)
                outs += [run.exit_out, run.halo_out]
                grads += msg
            link_in = [run.entry_in, run.halo_in] if work.incoming is not None else []
            wrt = inputs + link_in
            keep = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
            got = torch.autograd.grad([o for o, _ in keep], wrt, [g for _, g in keep], allow_unused=True)
            for i, g in enumerate(got[: len(inputs)]):
                if g is not None:
                    total[i] = g if total[i] is None else total[i] + g
            if work.incoming is not None:
                msg = [
                    torch.zeros_like(t) if g is None else g for t, g in zip(link_in, got[len(inputs) :], strict=True)
                ]
                if work.prev_peer is None:
                    handoff = msg
                else:
                    send_to(msg, shard, work.prev_peer)
        by_input = dict(zip((id(t) for t in inputs), total, strict=True))
        return (*(by_input.get(id(t)) for t in (xs, *params)), None, None, None)


def mix_chained(layer, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """The mixer outputs of ``layer`` (an ``IsoGatedDeltaNet``), fp32 ``[n, Hv, Dv]``, of this CP rank's rows
    (``qkv, b, a``, local order), the recurrence's state and the conv's history passed rank to rank (module
    docstring)."""
    kernel = layer.conv1d.weight.shape[-1]
    works = shard.memo(
        ("gdn_chain", layer.chunk, kernel),
        lambda: chain_plan(shard.bounds, shard.size, shard.rank, layer.chunk, kernel),
    )
    x = torch.cat([qkv, b, a], dim=-1)
    weight, A_log, dt_bias = layer.parameters_of_rule()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, A_log, dt_bias)):
        return _StateChain.apply(x, weight, A_log, dt_bias, layer, shard, works)
    runs = _forward_chain(layer, x, (weight, A_log, dt_bias), shard, works, leaves=False)
    return torch.cat([r.out for r in runs])
