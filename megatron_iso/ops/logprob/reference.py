"""Vocab log-softmax family, torch reference path: invariant to batch and to vocab-parallel layout.

For a row of temperature-scaled logits ``z = logits.float() / temperature`` over a vocab of V:
  m   = max(z)                                   exact in any order
  s   = sum_v exp(z_v - m)                       vocab cut into G leaves of V/G, leaf tree
  lse = m + log(s)
  logp(target) = z_target - lse
  entropy      = -sum_v p_v * (z_v - lse)        same leaf tree, p_v = exp(z_v - lse)

With the vocab split over C ranks (Megatron's contiguous vocab shards), rank i owns leaves
[iG/C, (i+1)G/C) and computes the node of the tree over them; the nodes are combined exactly as
the row-parallel GEMM's (``tree_sum`` in rank order). Only elementwise ops and the tree touch the
numbers, so every row's result is independent of the batch and of C.

The algorithm is written once over tensors with a leading *rank axis* R: in one process (ranks
simulated, or no TP) R = number of shards and the cross-rank steps reduce that axis; in a
distributed run R = 1 and a ``Comm`` performs the cross-rank steps with collectives. Both reduce
with the same ``tree_sum`` (``tree_sum_dim`` over the rank axis is bit-identical to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megatron_iso.ops.common.tree import tree_sum_dim
from megatron_iso.ops.gemm.reference import DEFAULT_LEAVES, check_dtype, validate_leaves

# Temperature tensors whose values were checked on the host before they were uploaded
# (:func:`host_checked_temperature`): :func:`scale_logits` does not read them back, a host sync
# per call on GPU. Weak keys: an entry goes with its tensor.
_HOST_CHECKED = WeakIdKeyDictionary()


def _check_temperature(t32: torch.Tensor, given: object) -> None:
    # On the fp32-rounded values (what divides): one read for both conditions (NaN fails isfinite).
    if bool(((t32 <= 0) | ~torch.isfinite(t32)).any()):
        raise ValueError(f"temperature must be finite and > 0 (after rounding to fp32), got {given!r}")


def host_checked_temperature(t: torch.Tensor, host_values: torch.Tensor) -> torch.Tensor:
    """``t``, marked as a valid temperature: the caller vouches that ``t`` holds ``host_values`` (a
    CPU tensor, checked here after rounding to fp32: finite and > 0), e.g. its device copy.
    ``scale_logits`` then skips its range check's read-back of ``t``. Returns ``t``."""
    if host_values.device.type != "cpu" or host_values.shape != t.shape:
        raise ValueError(
            f"host_values must be a CPU tensor of t's shape {tuple(t.shape)}, got "
            f"{tuple(host_values.shape)} on {host_values.device}"
        )
    _check_temperature(host_values.float(), host_values)
    _HOST_CHECKED[t] = True
    return t


def scale_logits(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """THE temperature scaling: fp32 upcast, then IEEE division by the fp32-rounded temperature.

    A 0-dim tensor divisor on the logits' device is used on purpose: dividing by a Python scalar
    lets some backends multiply by a reciprocal instead (a different rounding). A tensor
    temperature (e.g. per sequence, shape [..., 1]) broadcasts. The range check reads a tensor
    temperature back once (a host sync on GPU) unless it was checked on the host already
    (:func:`host_checked_temperature`); a Python number is checked on the host.
    """
    check_dtype(logits, "logits")
    return logits.float() / checked_temperature(temperature, logits.device)


def checked_temperature(temperature: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``temperature`` as an fp32 tensor on ``device``, checked finite and > 0 after rounding: a Python
    number on the host; a tensor by one read-back, unless :func:`host_checked_temperature` marked it."""
    if not isinstance(temperature, torch.Tensor):
        _check_temperature(torch.tensor(temperature, dtype=torch.float32), temperature)
        # A fill on the device, not a copy from the host: a blocking host-to-device copy waits for the stream.
        return torch.full((), temperature, dtype=torch.float32, device=device)
    t = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    if temperature not in _HOST_CHECKED:
        _check_temperature(t, temperature)
    return t


def temperature_rows(temperature: float | torch.Tensor, lead: Sequence[int], device: torch.device) -> torch.Tensor:
    """:func:`checked_temperature` as one contiguous fp32 value per row of logits ``[*lead, V]`` (``[prod(lead)]``),
    for a kernel that reads each row's temperature: a scalar is broadcast, a tensor of one value per row
    flattened, any other tensor broadcast as ``[*lead, 1]`` (e.g. one per sequence of ``[B, T]`` rows)."""
    t = checked_temperature(temperature, device)
    rows = torch.Size(lead).numel()
    if t.numel() == 1:
        return t.reshape(1).expand(rows).contiguous()
    if t.numel() == rows:
        return t.reshape(rows).contiguous()
    return torch.broadcast_to(t, (*lead, 1)).reshape(rows).contiguous()


def checked_valid_vocab(valid_vocab: int | None, vocab: int) -> int:
    """The count of real vocab ids (ids ``>= valid_vocab`` are Megatron's padding): ``vocab`` when None, else
    refused outside ``(0, vocab]``."""
    if valid_vocab is None:
        return vocab
    if not 0 < valid_vocab <= vocab:
        raise ValueError(f"valid_vocab={valid_vocab} outside (0, {vocab}]")
    return int(valid_vocab)


class Comm(Protocol):
    """Cross-rank steps of the algorithm over a leading rank axis (see module docstring)."""

    world: int  # C, number of vocab shards in total
    first_rank: int  # global shard index of rank-axis entry 0

    def max(self, t: torch.Tensor) -> torch.Tensor: ...  # [R, ...] -> [...]
    def tree(self, t: torch.Tensor) -> torch.Tensor: ...  # [R, ...] -> [...]
    def pick(self, t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor: ...  # [R, ...] -> [...] at global owner
    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor: ...  # [R, ..., V/C] -> [..., V] (native path)


class LocalShards:
    """All shards in this process: the rank axis holds every shard."""

    first_rank = 0

    def __init__(self, world: int) -> None:
        self.world = world

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return t.amax(dim=0)

    def tree(self, t: torch.Tensor) -> torch.Tensor:
        return tree_sum_dim(t, 0)

    def pick(self, t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        # Selection, no arithmetic: the owner's value bit for bit (even -0.0).
        return t.gather(0, owner.unsqueeze(0)).squeeze(0)

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(t.unbind(0)), dim=-1)


def mask_padding(z: torch.Tensor, first_rank: int, vocab: int, valid_vocab: int | None) -> torch.Tensor:
    """Set global vocab ids >= ``valid_vocab`` (Megatron's vocab padding) to -inf: exp gives exactly 0.

    ``z`` is [R, ..., V/C] holding global shards first_rank .. first_rank + R - 1 of a ``vocab``.
    """
    if valid_vocab is None:
        return z
    valid_vocab = checked_valid_vocab(valid_vocab, vocab)
    r, shard = z.shape[0], z.shape[-1]
    start = (first_rank + torch.arange(r, device=z.device)) * shard
    idx = start.view(r, *([1] * (z.dim() - 1))) + torch.arange(shard, device=z.device)
    return z.masked_fill(idx >= valid_vocab, float("-inf"))


def _leaf_partial(x: torch.Tensor, local_leaves: int) -> torch.Tensor:
    """[R, ..., V_local] -> [R, ...]: tree within each leaf, then tree over this shard's leaves."""
    leaves = x.unflatten(-1, (local_leaves, x.shape[-1] // local_leaves))
    return tree_sum_dim(tree_sum_dim(leaves, -1), -1)


class VocabScores:
    """Scaled logits of all local shards and the row statistics, computed once and reused."""

    def __init__(
        self,
        logits: torch.Tensor,
        comm: Comm,
        *,
        temperature: float | torch.Tensor = 1.0,
        leaves: int = DEFAULT_LEAVES,
        valid_vocab: int | None = None,
    ) -> None:
        """``logits``: [R, ..., V/C], the R local vocab shards (shard r is global shard first_rank + r)."""
        self._layout(logits, comm, leaves)
        # A tensor temperature ([..., 1]) broadcasts from the right over the rank axis too.
        self.z = z = mask_padding(scale_logits(logits, temperature), comm.first_rank, self.vocab, valid_vocab)
        with torch.no_grad():  # the max only shifts; d lse / d m = 0, so it carries no gradient
            self.m = comm.max(z.amax(dim=-1))
        self.lse = self.m + torch.log(comm.tree(_leaf_partial(torch.exp(z - self.m.unsqueeze(-1)), self.local_leaves)))

    def _layout(self, logits: torch.Tensor, comm: Comm, leaves: int) -> None:
        """The vocab's split: this rank's shard width, the whole vocab and the leaves a shard holds (checked)."""
        shard = logits.shape[-1]
        vocab = shard * comm.world
        validate_leaves(leaves, k=vocab, tp=comm.world)
        self.comm, self.shard, self.vocab = comm, shard, vocab
        self.local_leaves = leaves // comm.world
        if shard % self.local_leaves:
            raise ValueError(f"vocab shard {shard} is not divisible by its {self.local_leaves} leaves")

    def log_softmax(self) -> torch.Tensor:
        """[R, ..., V/C] fp32 log-probabilities of the local shards."""
        return self.z - self.lse.unsqueeze(-1)

    def token_logprobs(self, target_ids: torch.Tensor, *, ids_in_range: bool = False) -> torch.Tensor:
        """[...] fp32 log-probability of each row's target (global vocab ids). ``ids_in_range``: the
        caller guarantees every id is in ``[0, vocab)`` (e.g. ids it sampled from this vocab), so the
        check, a host read on a GPU, is skipped."""
        target_ids = self._checked_targets(target_ids, ids_in_range)
        owner = target_ids // self.shard  # global shard holding the target
        local = (target_ids - owner * self.shard).clamp(0, self.shard - 1)
        return self.comm.pick(self._z_at(local, target_ids), owner) - self.lse

    def _checked_targets(self, target_ids: torch.Tensor, ids_in_range: bool) -> torch.Tensor:
        """``target_ids`` as int64 on the scores' device, their shape and (unless ``ids_in_range``) range checked."""
        if target_ids.shape != self.lse.shape:
            raise ValueError(f"target_ids shape {tuple(target_ids.shape)} != logits rows {tuple(self.lse.shape)}")
        target_ids = target_ids.to(self.lse.device).long()
        if not ids_in_range and bool(((target_ids < 0) | (target_ids >= self.vocab)).any()):
            raise ValueError(f"target id outside [0, {self.vocab})")
        return target_ids

    def _z_at(self, local: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """[R, ...]: every local shard's scaled logit at column ``local`` of each row (the owner's is the target's)."""
        del target_ids  # z is masked already
        picked = self.z.gather(-1, local.unsqueeze(0).expand(self.z.shape[0], *local.shape).unsqueeze(-1))
        return picked.squeeze(-1)

    def entropy(self) -> torch.Tensor:
        """[...] fp32 entropy ``-sum p log p`` of each row, with the leaf tree."""
        logp = self.log_softmax()
        # p*logp where p == 0 (masked or underflow) is 0, not nan.
        plogp = torch.where(torch.isneginf(logp), torch.zeros_like(logp), torch.exp(logp) * logp)
        return -self.comm.tree(_leaf_partial(plogp, self.local_leaves))


def _stack(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(shards) == 0:
        raise ValueError("need at least one vocab shard")
    return torch.stack(list(shards), dim=0)


def token_logprobs_shards(
    shards: Sequence[torch.Tensor],
    target_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
) -> torch.Tensor:
    """Single-process form: ``shards`` are the C contiguous vocab shards [..., V/C] in rank order."""
    scores = VocabScores(
        _stack(shards), LocalShards(len(shards)), temperature=temperature, leaves=leaves, valid_vocab=valid_vocab
    )
    return scores.token_logprobs(target_ids)


def entropy_shards(
    shards: Sequence[torch.Tensor],
    *,
    temperature: float | torch.Tensor = 1.0,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
) -> torch.Tensor:
    """Single-process entropy over C vocab shards."""
    return VocabScores(
        _stack(shards), LocalShards(len(shards)), temperature=temperature, leaves=leaves, valid_vocab=valid_vocab
    ).entropy()


def log_softmax_shards(
    shards: Sequence[torch.Tensor],
    *,
    temperature: float | torch.Tensor = 1.0,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
) -> torch.Tensor:
    """Single-process full log-softmax [..., V] over C vocab shards (concatenated in rank order)."""
    scores = VocabScores(
        _stack(shards), LocalShards(len(shards)), temperature=temperature, leaves=leaves, valid_vocab=valid_vocab
    )
    return torch.cat(list(scores.log_softmax().unbind(0)), dim=-1)
