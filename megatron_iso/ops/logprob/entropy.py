"""Row entropy of ``softmax(logits / temperature)`` as a logged statistic, in one pass over the vocab.

The entropy is a metric (``policy/entropy``), never part of a loss or of a recorded logprob. The leaf-tree
``VocabScores.entropy`` materialises ``log_softmax``, ``exp`` and their product over ``[rows, vocab]`` in
fp32: many passes over the largest tensor of a training step. Here every vocab leaf (the logprob's leaves:
``leaves`` equal slices of the whole vocab) is reduced to three numbers per row, ``m = max z``,
``s = sum exp(z - m)`` and ``u = sum exp(z - m) * z``; the leaves' partials are gathered in vocab order and
combined in that order (:func:`entropy_from_partials`): ``H = M + log S - U / S``. A leaf's partials depend
on its values alone, so the result is the same bits for any number of rows in the launch and any number of
vocab shards (TP) holding the leaves, and there are no atomics (deterministic).

:func:`entropy_partials_reference` is the readable form (fp64 torch ops);
:mod:`megatron_iso.ops.logprob.entropy_triton` the kernel (one program per row and leaf) the tests hold to it
within fp32 accuracy. CUDA runs the kernel, other devices the leaf-tree ``VocabScores.entropy``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_iso.ops.common.dispatch import import_triton_module
from megatron_iso.ops.logprob.reference import checked_valid_vocab, temperature_rows

TRITON_MODULE = "megatron_iso.ops.logprob.entropy_triton"


def entropy_partials_reference(
    logits: torch.Tensor, temperature: torch.Tensor, leaves: int, valid: int, first: int
) -> torch.Tensor:
    """``[rows, leaves, 3]`` ``(m, s, u)`` of each leaf of each row of ``logits [rows, V_shard]``, in fp64
    (returned as fp32); global ids ``first + j`` at or past ``valid`` are masked."""
    z = logits.double() / temperature.double().reshape(-1, 1)
    ids = first + torch.arange(z.shape[-1], device=z.device)
    z = z.masked_fill(ids >= valid, float("-inf")).unflatten(-1, (leaves, -1))
    m = z.amax(dim=-1, keepdim=True)
    e = torch.where(m == float("-inf"), torch.zeros_like(z), torch.exp(z - m))
    u = torch.where(e > 0, e * z, torch.zeros_like(e)).sum(-1)
    return torch.stack([m.squeeze(-1), e.sum(-1), u], dim=-1).float()


def entropy_from_partials(parts: torch.Tensor) -> torch.Tensor:
    """``[rows, G, 3]`` partials of the G vocab leaves (vocab order) -> ``[rows]`` fp32 entropy. fp64 sums
    over the leaves in order: a fixed order, the same for any split of the leaves over ranks."""
    m, s, u = parts.double().unbind(-1)
    top = m.amax(dim=-1, keepdim=True)
    w = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - top))
    s_all, u_all = (s * w).sum(-1), (u * w).sum(-1)
    return (top.squeeze(-1) + torch.log(s_all) - u_all / s_all).float()


def _partials_fn(device: torch.device, temperature: float | torch.Tensor) -> Callable[..., torch.Tensor]:
    if device.type == "cuda":
        fn = import_triton_module(TRITON_MODULE, "the entropy statistic on CUDA").entropy_partials_triton
        scalar = None if isinstance(temperature, torch.Tensor) else float(temperature)
        return functools.partial(fn, scalar_temperature=scalar)
    return entropy_partials_reference


def row_entropy(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    leaves: int,
    world: int = 1,
    rank: int = 0,
    valid_vocab: int | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """fp32 entropy per row of this rank's vocab shard ``logits [..., V/world]`` (no gradient). ``leaves``: vocab
    leaves of the whole vocab (a multiple of ``world``); ``gather``: concatenates every rank's ``[rows, G/world,
    3]`` partials along dim 1 in rank order (None: one shard)."""
    lead, shard = logits.shape[:-1], logits.shape[-1]
    if leaves < world or leaves % world or shard % (leaves // world):
        raise ValueError(f"entropy: {leaves} leaves do not split a vocab of {world} shards of {shard}")
    valid = checked_valid_vocab(valid_vocab, shard * world)
    with torch.no_grad():
        x = logits.detach().reshape(-1, shard)
        t = temperature_rows(temperature, lead, x.device)
        parts = _partials_fn(x.device, temperature)(x, t, leaves // world, valid, rank * shard)
        return entropy_from_partials(parts if gather is None else gather(parts)).reshape(lead)


__all__ = ["entropy_from_partials", "entropy_partials_reference", "row_entropy"]
