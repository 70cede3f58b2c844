"""Run checkpoints: written atomically, resumed exactly.

Layout: ``<run>/checkpoints/step_<N>/`` holds one ``model_rank<r>.safetensors`` and one
``optim_rank<r>.pt`` per rank plus ``meta.json`` (step, layout, the contract's numerical_policy
digest). A checkpoint is first written to a temporary sibling directory and renamed into place
(atomic on POSIX), and ``latest`` is replaced atomically after it, so a crash never leaves a
half-written checkpoint that resume would pick. Optimizer state is loaded with
``weights_only=True``; weights with safetensors. Weights holding a NaN or an Inf are never written,
and a damaged checkpoint is named together with the newest complete one before it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megatron_iso.errors import UserError, check_finite
from megatron_iso.rl.optim import distributed_parts


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, damaged, or from another contract/layout/identity."""


def _dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    run_dir: Path, step: int, model: torch.nn.Module, optimizer: Any, meta: dict[str, Any], *, rank: int
) -> Path:
    """All ranks call this; rank 0 publishes the directory once every rank has written its files."""
    final = _dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    check_finite(model.named_parameters(), f"step {step}: refusing to write checkpoint {final}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    params = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    save_file(params, str(tmp / f"model_rank{rank}.safetensors"))
    torch.save(_optimizer_state(optimizer), tmp / f"optim_rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, sort_keys=True, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = run_dir / "checkpoints" / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, run_dir / "checkpoints" / "latest")
    _barrier()
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's published checkpoints (renamed into place, with ``meta.json``), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / "meta.json").is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(
            f"{pointer} points at {path}, which has no meta.json (incomplete checkpoint){_fallback(path)}"
        )
    return path


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _fallback(damaged: Path) -> str:
    """The way out of a damaged checkpoint: the newest complete one before it, if any."""
    earlier = [p for p in complete_checkpoints(damaged.parent.parent) if p.name < damaged.name]
    if not earlier:
        return "; no earlier complete checkpoint exists"
    return (
        f"; the newest complete checkpoint before it is {earlier[-1]}: move {damaged.name} out of "
        f"{damaged.parent} and write {earlier[-1].name} into {damaged.parent / 'latest'} to resume from it"
    )


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: Any, expect: dict[str, Any], *, rank: int
) -> dict[str, Any]:
    """Load this rank's files after checking ``meta.json`` agrees with ``expect`` (contract, layout)."""
    meta = json.loads((path / "meta.json").read_text())
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} was written with {key}={meta.get(key)!r}, this run has {key}={value!r}; "
                "refusing to resume (start a new out_dir or restore the original config)"
            )
    weights = path / f"model_rank{rank}.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"checkpoint {path} has no {weights.name} (written with another world size?)")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {weights}: {_first_line(exc)}{_fallback(path)}") from None
    check_finite(state.items(), f"checkpoint {weights}")
    params = dict(model.named_parameters())
    if set(state) != set(params):
        raise CheckpointError(
            f"checkpoint {weights} parameter names differ from the model's: {sorted(set(state) ^ set(params))[:5]}"
        )
    shapes = [
        f"{n} {list(t.shape)} (model {list(params[n].shape)})" for n, t in state.items() if t.shape != params[n].shape
    ]
    if shapes:
        raise CheckpointError(
            f"checkpoint {weights} holds tensors of other shapes than this model: {', '.join(shapes[:3])}; "
            "the model config differs from the run that wrote it"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    optim = path / f"optim_rank{rank}.pt"
    try:
        optim_state = torch.load(optim, weights_only=True)
    except Exception as exc:  # a damaged pickle raises one of many types; the file is what matters
        raise CheckpointError(f"cannot read {optim}: {_first_line(exc)}{_fallback(path)}") from None
    _load_optimizer_state(optimizer, optim_state, optim)
    return meta


# The key of a distributed optimizer's sharded Adam state in its optim_rank<r>.pt (absent: a replicated one's).
_PARAM_STATE = "distributed_param_state"


def _optimizer_state(optimizer: Any) -> dict[str, Any]:
    """What ``optim_rank<r>.pt`` holds: the optimizer's ``state_dict()`` (a replicated optimizer's whole state), or
    for Megatron's distributed optimizer its state_dict (param groups and step, no tensors) plus, per chained
    part, the DP group's Adam state and main weights gathered to DP rank 0 by Megatron's
    ``get_parameter_state_dp_zero`` (a collective; None on the other DP ranks)."""
    parts = distributed_parts(optimizer)
    if not parts:
        return optimizer.state_dict()
    return {"optimizer": optimizer.state_dict(), _PARAM_STATE: [p.get_parameter_state_dp_zero() for p in parts]}


def _load_optimizer_state(optimizer: Any, state: dict[str, Any], path: Path) -> None:
    parts = distributed_parts(optimizer)
    if bool(parts) != (_PARAM_STATE in state):
        raise CheckpointError(
            f"{path} was written with rl.use_distributed_optimizer={not parts}, this run has "
            f"rl.use_distributed_optimizer={bool(parts)}; resume with the setting the run was written with"
        )
    if not parts:
        optimizer.load_state_dict(state)
        return
    saved = state[_PARAM_STATE]
    if len(saved) != len(parts):
        raise CheckpointError(f"{path} holds {len(saved)} distributed optimizer parts, this run has {len(parts)}")
    optimizer.load_state_dict(state["optimizer"])  # param groups, step; Adam's tensors as placeholders
    # Scattered from DP rank 0 (a collective). No autograd: with fp32 weights the main weights Adam updates are
    # views of the model's parameters, and Megatron's loader copies into them in place.
    with torch.no_grad():
        for part, part_state in zip(parts, saved, strict=True):
            # torch's Adam (Megatron's choice without Apex or Transformer Engine) keeps a "step" tensor in each
            # parameter's state, which Megatron's loader expects to hold only param / exp_avg / exp_avg_sq: it is
            # set aside while the loader runs (its value came from the param groups above). Megatron's
            # load_state_dict gave every parameter the same step tensor, and torch's Adam increments each
            # parameter's step in place: shared, it would advance once per parameter. Each gets its own copy.
            steps = {p: st.pop("step") for p, st in part.optimizer.state.items() if "step" in st}
            try:
                part.load_parameter_state_from_dp_zero(part_state)
            finally:
                for p, step in steps.items():
                    part.optimizer.state[p]["step"] = step.clone()
