"""What one model call computes: packed token rows plus, for rollout, where their keys live.

Every case runs the same module code on a packed ``[T]`` token row (Megatron's ``thd`` layout,
batch dimension 1); only this object changes:

- training forward / scoring: ``cu_seqlens`` delimit the sequences, ``positions`` restart at 0;
- prefill: the same, plus ``kv_cache`` and ``slots`` (one cache row per sequence) and
  ``cache_seqlens`` (tokens already cached, 0 for a fresh prompt, > 0 for a prefix-cache hit or
  chunked prefill); keys are written before attention reads them;
- decode: a prefill whose sequences are one token long.

It travels through Megatron's ``GPTModel -> TransformerBlock -> TransformerLayer`` as the
``packed_seq_params`` argument, which Megatron passes to the attention module untouched.

Sequence parallelism splits the ``T`` rows evenly over the TP ranks, so every model call's ``T`` must
divide by :func:`row_multiple`. Each case reaches it with filler rows that are sequences of their own
(sequences never attend to each other, so a filler changes no other row's bits): the trainer's pack
appends one filler sequence (``pack(pad_to_multiple=...)``); the rollout engine, whose sequences' keys
live in a KV cache, appends one-token filler sequences at position 0 that write and read only the
cache's scratch block (``inference.engine``), as a decode graph's padding rows do.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_iso.ops.attention.kv_cache import KVCache, KVStepPlan
from megatron_iso.ops.gdn.state_cache import GDNStateCache
from megatron_iso.ops.rope import check_position
from megatron_iso.parallel.context import ContextShard

CASES = ("trainer_forward", "prefill", "decode")


@dataclass
class IsoBatch(PackedSeqParams):
    positions: torch.Tensor | None = None  # [T] absolute position of each packed token
    case: str = "trainer_forward"
    kv_cache: KVCache | None = None
    slots: torch.Tensor | None = None  # [n] cache row of each sequence
    cache_seqlens: torch.Tensor | None = None  # [n] tokens already in the cache per sequence
    gdn_cache: GDNStateCache | None = None  # conv/recurrent state of GDN layers (hybrid models)
    gdn_slots: torch.Tensor | None = None  # [n] GDN state row of each sequence (None: the same as ``slots``)
    # Host copy of cu_seqlens_q / cache_seqlens / slots (pack knows them as lists): the attention
    # layers read it instead of syncing on the tensors, and share index tensors built from it.
    kv_plan: KVStepPlan | None = None
    # Largest |position| (pack knows it from host ints and range-checks it there): RoPE's range
    # check uses it instead of reading ``positions`` back (a host sync on GPU). None: RoPE reads them.
    max_position: int | None = None
    # Layers whose eager forward reads device values on the host take their static-shape path instead (MoE
    # layers: ``models.moe.static_shapes``, EP 1): DecodeGraphs sets it on its buckets' batches (a captured
    # call reads nothing on the host), the trainer on its micro-batches (no sync per layer). The same bits.
    static_shapes: bool = False
    # Every token id is in [0, ids_checked_below), checked by pack on the host (``pack(vocab_size=...)``): scoring
    # the rows' next tokens against a vocab at least this large skips the range check, a host read per LM-head
    # chunk on a GPU (``models.scoring``). None: unchecked.
    ids_checked_below: int | None = None
    # Context parallelism: this rank's share of a trainer pack (``models.context.shard_for_context``); its
    # attention gathers every rank's keys. None: the rows are the whole pack.
    cp: ContextShard | None = None
    # A trainer pack's recorded rollout routing (``models.routing.RoutingTarget``, ``rl.routing_replay``): its MoE
    # routers compare their top-k with it and, with replay, use it. None: they route on their own.
    routing: object | None = None
    # Per-call values every layer would compute the same way (RoPE cos/sin of ``positions``), built
    # by the first layer that needs them: the same function of the same inputs, so the same bits.
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def uses_cache(self) -> bool:
        return self.kv_cache is not None


def row_multiple(config) -> int:
    """What every model call's packed row count ``T`` must divide by: the TP size under sequence parallelism
    (each rank holds ``T / TP`` rows between the layers), else 1."""
    if getattr(config, "sequence_parallel", False):
        return int(config.tensor_model_parallel_size)
    return 1


def _to(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _check_token_ids(toks: Sequence[torch.Tensor], lengths: Sequence[int], vocab_size: int) -> None:
    """Every id of the sequences (``toks``: their ids, one tensor or one per sequence; ``lengths``: theirs) in
    ``[0, vocab_size)``; else an error naming the first bad id, its sequence and place, and the vocab size."""
    flat = torch.cat(list(toks))
    bad = ((flat < 0) | (flat >= vocab_size)).nonzero()
    if bad.numel():
        at = int(bad[0, 0])
        seq = next(i for i, end in enumerate(itertools.accumulate(lengths)) if at < end)
        offset = at - sum(lengths[:seq])
        raise ValueError(
            f"pack: sequence {seq} holds token id {int(flat[at])} at position {offset}, outside the model's vocab "
            f"[0, {vocab_size}) (model.vocab_size={vocab_size})"
        )


def _cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    if any(n <= 0 for n in lengths):
        raise ValueError(f"every sequence needs at least one token, got lengths {list(lengths)}")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return cu


def pack(
    sequences: Sequence[Sequence[int]] | Sequence[torch.Tensor],
    *,
    start_positions: Sequence[int] | None = None,
    case: str = "trainer_forward",
    kv_cache: KVCache | None = None,
    slots: Sequence[int] | None = None,
    gdn_cache: GDNStateCache | None = None,
    gdn_slots: Sequence[int] | None = None,
    pad_to_multiple: int = 1,
    device: torch.device | str = "cpu",
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, IsoBatch]:
    """Pack token sequences into ``input_ids [1, T]`` and their :class:`IsoBatch`.

    ``start_positions[i]`` is the absolute position of sequence i's first token (its cached length
    for prefill continuation and decode; 0 otherwise). ``pad_to_multiple`` (training forward only)
    appends a filler sequence of token 0 so that T divides it (sequence parallelism splits rows
    evenly: :func:`row_multiple`); sequences never attend to each other, so the filler changes no
    other row. (A prefill or decode step's fillers need a cache slot each: the engine passes them as
    sequences of their own, module docstring.)
    ``gdn_slots`` lets the GDN state rows differ from the KV rows (the engine stages KV per step but
    keeps each sequence's GDN state in place); by default the GDN layers use ``slots``.
    ``vocab_size``: check every token id is in ``[0, vocab_size)`` here, on the host values (an error names the
    sequence, the id and the vocab size), and mark the batch (``ids_checked_below``) so its scoring reads nothing
    back to check them again.
    """
    if case not in CASES:
        raise ValueError(f"case={case!r} is not allowed; allowed values: {list(CASES)}")
    if (kv_cache is None) != (case == "trainer_forward"):
        raise ValueError(f"case={case!r}: a kv_cache is required for prefill/decode and forbidden for trainer_forward")
    if all(isinstance(s, list | tuple) for s in sequences):  # the engine's case: one tensor, not one per sequence
        lengths = [len(s) for s in sequences]
        toks = [torch.tensor([t for s in sequences for t in s], dtype=torch.int64)]
    else:
        toks = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in sequences]
        lengths = [int(t.numel()) for t in toks]
    if vocab_size is not None:
        _check_token_ids(toks, lengths, vocab_size)
    pad = -sum(lengths) % pad_to_multiple
    if pad:
        if case != "trainer_forward":
            raise ValueError(f"pad_to_multiple={pad_to_multiple} is only supported for case='trainer_forward'")
        toks.append(torch.zeros(pad, dtype=torch.int64))
        lengths.append(pad)
    if case == "decode" and any(n != 1 for n in lengths):
        raise ValueError(f"case='decode' takes one token per sequence, got lengths {lengths}")
    starts = list(start_positions) if start_positions is not None else [0] * len(lengths)
    if len(starts) != len(lengths):
        raise ValueError(f"start_positions has {len(starts)} entries for {len(lengths)} sequences")
    # RoPE's exact range, checked on the host ints (the largest |position| of a sequence is at one
    # of its ends); the forward then never reads positions back to check them.
    max_position = 0
    for i, (a, n) in enumerate(zip(starts, lengths, strict=True)):
        top = max(abs(int(a)), abs(int(a) + n - 1))
        check_position(top, where=f"pack: sequence {i} (start_positions[{i}]={a}, {n} tokens): ")
        max_position = max(max_position, top)
    # Absolute positions without a per-sequence arange: start of its sequence + offset within it.
    counts = torch.tensor(lengths, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    offset = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[seq]
    positions = torch.tensor(starts, dtype=torch.int64)[seq] + offset
    # non_blocking: a blocking host-to-device copy is a host sync on GPU (pageable sources are
    # staged by the driver before the call returns, so the temporaries may go).
    cu = _cu_seqlens(lengths).to(device, non_blocking=True)
    plan = None
    if kv_cache is not None:
        if slots is None or len(slots) != len(lengths):
            raise ValueError("prefill/decode need one cache slot per sequence (slots=...)")
        bounds = [0, *itertools.accumulate(lengths)]
        plan = KVStepPlan(bounds, [int(s) for s in starts], [int(s) for s in slots])
    batch = IsoBatch(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
        positions=positions.to(device, non_blocking=True),
        case=case,
        kv_cache=kv_cache,
        slots=None if slots is None else _to(list(slots), device),
        cache_seqlens=None if kv_cache is None else _to(starts, device),
        gdn_cache=gdn_cache,
        gdn_slots=None if gdn_slots is None else _to(list(gdn_slots), device),
        kv_plan=plan,
        max_position=max_position,
        ids_checked_below=vocab_size,
    )
    if gdn_cache is not None and kv_cache is None:
        raise ValueError("gdn_cache is given without kv_cache: prefill/decode of a hybrid model needs both")
    if batch.gdn_slots is not None and (gdn_cache is None or batch.gdn_slots.numel() != len(lengths)):
        raise ValueError("gdn_slots needs a gdn_cache and one GDN slot per sequence")
    if kv_cache is not None and (batch.slots is None or batch.slots.numel() != len(lengths)):
        raise ValueError("prefill/decode need one cache slot per sequence (slots=...)")
    return torch.cat(toks).unsqueeze(0).to(device, non_blocking=True), batch
