"""Run checkpoints: written atomically, resumed exactly.

Layout: ``<run>/checkpoints/step_<N>/`` holds one ``model_rank<r>.safetensors`` and one
``optim_rank<r>.pt`` per rank plus ``meta.json`` (step, layout, the contract's numerical_policy
digest). A checkpoint is first written to a temporary sibling directory and renamed into place
(atomic on POSIX), and ``latest`` is replaced atomically after it, so a crash never leaves a
half-written checkpoint that resume would pick. Optimizer state is loaded with
``weights_only=True``; weights with safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or from another contract/layout."""


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
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    params = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    save_file(params, str(tmp / f"model_rank{rank}.safetensors"))
    torch.save(optimizer.state_dict(), tmp / f"optim_rank{rank}.pt")
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


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{pointer} points at {path}, which has no meta.json (incomplete checkpoint)")
    return path


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
    state = load_file(str(weights))
    params = dict(model.named_parameters())
    if set(state) != set(params):
        raise CheckpointError(
            f"checkpoint {weights} parameter names differ from the model's: {sorted(set(state) ^ set(params))[:5]}"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(path / f"optim_rank{rank}.pt", weights_only=True))
    return meta
