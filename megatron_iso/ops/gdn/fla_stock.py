"""The stock GPU kernels of the Gated DeltaNet rule for the performance profile's rollout: FLA's.

Where ``fla`` (the ``fla-core`` wheel) is installed, the rollout's calls of the rule (a state cache given, no autograd,
CUDA) run FLA's chunk kernel (prefill) and fused recurrent kernel (decode steps), and the registry names them for the
``prefill`` and ``decode`` cases (:func:`registry_entry`); the trainer, its scoring included, keeps
:mod:`.native`'s torch chunk algorithm. Both entry points are called with keywords only: in fla-core 0.6.0 the fifth
positional parameter of ``fused_recurrent_gated_delta_rule`` is ``gk``, not beta. Every layout conversion is explicit
(FLA's value-head grouping ``i_h = i_hv // (HV // H)`` is ``repeat_interleave``'s, so q and k go in unrepeated).

Why, and the layouts: docs/GDN.md, "Native path (performance profile)".
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import itertools
from collections.abc import Callable, Mapping

import torch

from megatron_iso.ops.gdn.state_cache import GDNLayerState

FLA_DISTRIBUTION = "fla-core"
FLA_CHUNK = "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
FLA_RECURRENT = "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule"
# FLA's default chunk, the one vLLM and SGLang run (its chunk kernel takes 16, 32 or 64).
FLA_CHUNK_SIZE = 64
FLA_CHUNK_SIZES = (16, 32, 64)


def installed() -> bool:
    """Whether ``fla`` is installed, without importing it (it imports Triton and its kernels' modules)."""
    return importlib.util.find_spec("fla") is not None


def fla_version() -> str:
    """The installed fla-core's version ("unknown" for an ``fla`` without package metadata)."""
    try:
        return importlib.metadata.version(FLA_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def entry_points() -> tuple[Callable, Callable]:
    """``(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)``. An installed FLA that does not import is an
    error, not a silent fallback: the registry names FLA's kernels for the rollout wherever ``fla`` is installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as exc:
        raise RuntimeError(
            f"gated_delta_rule (performance profile): {FLA_DISTRIBUTION} is installed but `import "
            f"fla.ops.gated_delta_rule` failed ({type(exc).__name__}: {exc}); fix the install or uninstall "
            f"{FLA_DISTRIBUTION} (the rollout then runs the torch recurrence)"
        ) from exc
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def serves(q: torch.Tensor, state: GDNLayerState | None, *tensors: torch.Tensor) -> bool:
    """Whether FLA serves this call: a rollout call (a state cache given) on CUDA, no gradient needed, FLA
    installed. Trainer calls (no state cache), with or without autograd, run the torch chunk algorithm."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, *tensors))
    return state is not None and q.is_cuda and not needs_grad and installed()


def registry_entry() -> tuple[dict[str, str], dict[str, str]]:
    """``(constants, case_impls)`` of the cuda performance entry where FLA serves the rollout: the kernels, their
    package version and chunk size, and the ``prefill`` / ``decode`` cases as served by them."""
    version = f"{FLA_DISTRIBUTION}-{fla_version()}"
    constants = {
        "rollout_prefill": f"{FLA_CHUNK} ({version}, chunk {FLA_CHUNK_SIZE})",
        "rollout_decode": f"{FLA_RECURRENT} ({version})",
        "rollout_dtypes": "q, k, v, beta in v's dtype; g and states fp32",
    }
    case_impls = {"prefill": f"{FLA_CHUNK}@{version}", "decode": f"{FLA_RECURRENT}@{version}"}
    return constants, case_impls


def _rows(x: torch.Tensor, cu: list[int], group: list[int], whole: bool) -> torch.Tensor:
    """The packed rows of ``group``'s sequences, in order (``x`` itself when the group is the whole call)."""
    if whole:
        return x
    return torch.cat([x[cu[i] : cu[i + 1]] for i in group])


def rollout_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu: list[int],
    st: list[int],
    *,
    scale: float,
    state: GDNLayerState,
    slots: torch.Tensor,
    chunk_size: int = FLA_CHUNK_SIZE,
) -> torch.Tensor:
    """fp32 ``[T, Hv, Dv]`` from FLA's kernels: one-token steps of resumed sequences through the fused recurrent
    kernel, every other sequence through the chunk kernel (a call holding both runs each on its own rows, as
    vLLM does). Each sequence starts from its slot's running state when it resumes (``st > 0``), else from zeros,
    and its final state goes back to the slot. ``cu`` / ``st``: the call's host lists (cumulative lengths, start
    positions); ``cu_seqlens`` the same on the device. ``chunk_size``: one of FLA's (tests use 16 to cross chunk
    boundaries with few tokens)."""
    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"rollout_rule: chunk_size={chunk_size} is not allowed; allowed values: {FLA_CHUNK_SIZES}")
    chunk_rule, recurrent_rule = entry_points()
    io = v.dtype  # FLA's input dtype: the model's (v leaves the conv in it); q, k, beta follow it
    hv, dv = v.shape[1:]
    lens = [b - a for a, b in itertools.pairwise(cu)]
    decode = [i for i, n in enumerate(lens) if n == 1 and st[i] > 0]
    chunked = [i for i, n in enumerate(lens) if not (n == 1 and st[i] > 0)]
    out = torch.empty(q.shape[0], hv, dv, dtype=torch.float32, device=q.device)
    slot_all = slots.to(device=q.device, dtype=torch.long)
    for group, is_decode in ((decode, True), (chunked, False)):
        if not group:
            continue
        whole = len(group) == len(lens)
        qg, kg, vg, gg, bg = (_rows(x, cu, group, whole) for x in (q, k, v, g, beta))
        args: Mapping[str, torch.Tensor] = {
            "q": qg.to(io),
            "k": kg.to(io),
            "v": vg,
            "g": gg.float(),  # log decay, fp32 (FLA accumulates its cumsum in fp32)
            "beta": bg.to(io),
        }
        slot_ids = slot_all if whole else slot_all[group]
        resumed = [st[i] > 0 for i in group]
        h0 = None  # FLA starts from zeros without an initial state: a prefill of fresh sequences reads no slot
        if any(resumed):
            h0 = state.running[slot_ids]  # [N, Hv, Dk, Dv] = FLA's [N, HV, K, V]: no transpose
            if not all(resumed):
                keep = torch.tensor(resumed, device=q.device)[:, None, None, None]
                h0 = torch.where(keep, h0, torch.zeros_like(h0))
        common = {
            "scale": scale,
            "initial_state": h0,
            "output_final_state": True,
            "use_qk_l2norm_in_kernel": False,  # q and k come l2-normalised (the gdn_l2norm op)
            "state_v_first": False,  # state [K, V] per head, as state.running holds it
        }
        if is_decode:
            # [N, 1, H, D]: one token per sequence, the batch dimension is the sequence (no cu_seqlens).
            o, s = recurrent_rule(**{n: x.unsqueeze(1) for n, x in args.items()}, **common)
            o = o.squeeze(1)
        else:
            # [1, T, H, D] with cu_seqlens: FLA's varlen batch of one.
            gl = [lens[i] for i in group]
            cu_host = torch.tensor([0, *itertools.accumulate(gl)], dtype=torch.long)
            cu_dev = cu_seqlens.to(device=q.device, dtype=torch.long) if whole else cu_host.to(q.device)
            o, s = chunk_rule(
                **{n: x.unsqueeze(0) for n, x in args.items()},
                **common,
                cu_seqlens=cu_dev,
                cu_seqlens_cpu=cu_host,  # FLA's chunk indices from the host copy: no device read-back
                chunk_size=chunk_size,
            )
            o = o.squeeze(0)
        if whole:
            out = o.float()
        else:
            dst = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in group]).to(q.device)
            out[dst] = o.float()
        state.running[slot_ids] = s.float()
    return out


__all__ = [
    "FLA_CHUNK",
    "FLA_CHUNK_SIZE",
    "FLA_RECURRENT",
    "entry_points",
    "fla_version",
    "installed",
    "registry_entry",
    "rollout_rule",
    "serves",
]
