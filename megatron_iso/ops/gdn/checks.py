"""The Gated DeltaNet family's argument checks, one of each: the reference, the native path and the Triton kernels
call these, so every implementation refuses the same calls with the same words.

The host-list checks take the call's sequence boundaries and starts as Python lists: each implementation reads them
from the device its own way (once per forward, cached across the layers), and a check must not read them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_iso.ops.gdn.state_cache import GDNLayerState


def check_starts(starts: Sequence[int], n: int) -> None:
    """One start (the sequence's position before this call) per sequence, none negative."""
    if len(starts) != n:
        raise ValueError(f"starts has {len(starts)} entries for {n} sequences")
    if any(s < 0 for s in starts):
        raise ValueError(f"starts must be >= 0, got {list(starts)}")


def check_state_slots(
    has_state: bool,
    slots: torch.Tensor | Sequence[int] | None,
    n: int,
    starts: Sequence[int] = (),
    *,
    conv: bool = False,
) -> None:
    """A state for a call that continues any of its ``n`` sequences (a start > 0; ``starts`` is read only without a
    state), and with a state one slot per sequence. ``conv``: the conv state (``conv_state=``), else the GDN state
    cache (``state=``)."""
    what, arg = ("conv state", "conv_state") if conv else ("GDN state cache", "state")
    if not has_state and any(starts):
        raise ValueError(f"sequences starting at positions {list(starts)} need their {what} ({arg}=..., slots=...)")
    n_slots = None if slots is None else slots.numel() if isinstance(slots, torch.Tensor) else len(slots)
    if has_state and n_slots != n:
        raise ValueError(f"a {what} needs one slot per sequence (slots=...)")


def check_nonempty(cu: Sequence[int]) -> None:
    """Every sequence of a gated delta rule call has a token (an empty one has no state to carry)."""
    empty = [i for i in range(len(cu) - 1) if cu[i + 1] <= cu[i]]
    if empty:
        raise ValueError(f"gated_delta_rule: sequences {empty} have no tokens in cu_seqlens={list(cu)}; drop them")


def check_rule_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int,
    state: GDNLayerState | None,
) -> None:
    """The rule's tensors fit q/k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]``, g/beta ``[T, Hv]`` with Hv a multiple of Hk;
    ``chunk`` a positive int, and the state cache's own chunk."""
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"gated_delta_rule: k{tuple(k.shape)} and v{tuple(v.shape)} must be [T, heads, dim]")
    t, hk, _ = k.shape
    hv = v.shape[1]
    if q.shape != k.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(
            f"gated_delta_rule: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} g{tuple(g.shape)} "
            f"beta{tuple(beta.shape)} do not fit q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv]"
        )
    if hv % hk:
        raise ValueError(f"gated_delta_rule: value heads {hv} must be a multiple of key heads {hk}")
    if chunk <= 0:
        raise ValueError(f"gated_delta_rule: chunk must be a positive int, got {chunk}")
    if state is not None and state.chunk != chunk:
        raise ValueError(f"gated_delta_rule: state cache chunk {state.chunk} != chunk {chunk}")


def check_entry(entry: torch.Tensor, n: int, hv: int, dk: int, dv: int) -> None:
    """A carried call's entry states: float32 ``[sequences, value heads, key dim, value dim]``."""
    if tuple(entry.shape) != (n, hv, dk, dv) or entry.dtype != torch.float32:
        raise ValueError(
            f"gated_delta_rule_carry: entry is {entry.dtype} {tuple(entry.shape)}; it must be float32 "
            f"[sequences={n}, value heads={hv}, key dim={dk}, value dim={dv}]"
        )


def check_conv_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """``x [T, Cd]`` and a depthwise ``weight [Cd, K]``."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        cd = x.shape[-1] if x.dim() else "?"
        raise ValueError(f"causal_conv1d: weight shape {tuple(weight.shape)} != (channels={cd}, kernel)")
