"""The stock GPU kernels of the Gated DeltaNet rule for the performance profile's rollout: FLA's.

A user who does not run the correctness profile runs FLA (flash-linear-attention): its chunk kernel for prefill and
its fused recurrent kernel for one-token decode steps, the split vLLM and SGLang make. Those are the two entry points
used here, for calls without autograd on CUDA, when ``fla`` imports. Training keeps :mod:`.native`'s torch chunk
algorithm: fla-core refuses its gated chunk backward on Hopper with 3.4 <= Triton < 3.7.1 (fla issue #640), and a
forward by one library with a backward by another would not be what any stack runs.

Layout: the package's packed rows (``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g, beta [T, Hv]``) are FLA's varlen
batch of one (``[1, T, H, D]`` with ``cu_seqlens``); FLA applies grouped value heads itself. Each sequence starts
from its slot's running state (``state.running``) when it resumes (``starts > 0``), else from zeros, and its final
state goes back to the slot, as :func:`.native.gated_delta_rule` does.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections.abc import Callable

import torch

from megatron_iso.ops.gdn.state_cache import GDNLayerState


def installed() -> bool:
    """Whether an ``fla`` package is installed (without importing it: it needs a GPU stack)."""
    return importlib.util.find_spec("fla") is not None


@functools.cache
def fla_entry_points() -> tuple[Callable, Callable] | None:
    """``(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)``, or None where FLA is not importable."""
    if not installed():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # an FLA that does not import on this machine (no GPU stack): the torch path serves
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def serves(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether FLA serves this call: CUDA, no gradient needed, FLA importable."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, *tensors))
    return q.is_cuda and not needs_grad and fla_entry_points() is not None


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu: list[int],
    st: list[int],
    *,
    scale: float,
    state: GDNLayerState | None,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 ``[T, Hv, Dv]``: FLA's fused recurrent kernel when every sequence is a one-token decode step, else its
    chunk kernel; ``cu`` / ``st`` the call's host lists (cumulative lengths, start positions)."""
    entry = fla_entry_points()
    if entry is None:
        raise RuntimeError("fla_gated_delta_rule: FLA (fla-core) is not importable here")
    chunk, recurrent = entry
    n = len(cu) - 1
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    s0 = torch.zeros(n, hv, dk, dv, dtype=torch.float32, device=q.device)
    slot_ids = None
    if state is not None:
        slot_ids = slots.to(device=q.device, dtype=torch.long)
        resumed = torch.tensor([s > 0 for s in st], device=q.device)
        s0 = torch.where(resumed[:, None, None, None], state.running[slot_ids], s0)
    cu_dev = torch.tensor(cu, dtype=torch.long, device=q.device)
    decode = all(b - a == 1 for a, b in itertools.pairwise(cu)) and all(s > 0 for s in st)
    rule = recurrent if decode else chunk
    dtype = v.dtype
    o, s = rule(
        q.to(dtype).unsqueeze(0),
        k.to(dtype).unsqueeze(0),
        v.unsqueeze(0),
        g.float().unsqueeze(0),
        beta.to(dtype).unsqueeze(0),
        scale=scale,
        initial_state=s0,
        output_final_state=True,
        cu_seqlens=cu_dev,
    )
    if state is not None:
        state.running[slot_ids] = s.float()
    return o.squeeze(0).float()


__all__ = ["fla_entry_points", "fla_gated_delta_rule", "installed", "serves"]
