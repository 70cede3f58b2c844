"""Run checkpoints: Megatron-Core distributed checkpoints, written atomically, resumed at any layout.

Layout: ``<run>/checkpoints/step_<N>/`` is a ``megatron.core.dist_checkpointing`` directory (the ``torch_dist``
backend: torch.distributed.checkpoint files, ``common.pt``, ``metadata.json``) holding the model's and the
optimizer's sharded state dicts, plus our ``meta.json`` (format, step, the layout it was written at, the
contract's numerical_policy digest, the run identity). Every tensor is stored once under its global name and
shape (``model.sharded_state_dict()``: a TP shard is a slice of it, replicas are written by one rank), and the
optimizer's state is keyed by the parameter it belongs to (``optimizer.sharded_state_dict``; the distributed
optimizer in Megatron's ``fully_reshardable`` form), so a checkpoint written at one TP / DP / PP layout loads at
another: each rank reads its own slices. Loading copies stored bits, so weights and Adam state are those saved,
bit for bit, whatever the layout.

A checkpoint is first written to a temporary sibling directory, then ``meta.json``, then ``checksums.json`` (a
SHA-256 of every other file: ``checkpoint.integrity``), and renamed into place (atomic on POSIX); ``latest`` is
replaced atomically after it, so a crash, or an error during the save, never leaves a half-written checkpoint that
resume would pick. A resume checks every file against its recorded digest before reading any. ``rl.keep_checkpoints``
prunes all but the newest N complete checkpoints after a publish. Weights holding a NaN or an Inf are never written
nor loaded, and a damaged or altered checkpoint is named together with the newest complete one before it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_iso.checkpoint.integrity import (
    CHECKSUMS,
    DECLARED,
    META,
    IntegrityError,
    offer_previous,
    record_checksums,
    verify_checksums,
)
from megatron_iso.checkpoint.integrity import complete_checkpoints as _complete_in
from megatron_iso.checkpoint.run_ckpt import (
    DIST_FORMAT,
    LEGACY_RANK_FILE,
    READ_ERRORS,
    dist_backend,
    quiet_dist_checkpointing,
    sharded_metadata,
)
from megatron_iso.errors import UserError, check_finite
from megatron_iso.rl.optim import ensure_adam_state, load_optimizer_state


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, damaged, or from another contract/identity."""


def _dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _write_failure(exc: BaseException) -> str | None:
    """Why a checkpoint write failed, when the disk refused it (full, over quota, or over the process's file size
    limit: torch's writers then report a short write as "unexpected pos"); None for any other error."""
    import errno

    causes = [exc, exc.__cause__, exc.__context__, *getattr(exc, "failures", {}).values()]  # per-rank failures
    for e in causes:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return f"{os.strerror(e.errno)} (disk full, quota or file size limit)"
    text = " ".join(str(e) for e in causes if e is not None)
    if "unexpected pos" in text or "file write failed" in text:
        return "the file could not be written in full (disk full, quota or file size limit)"
    return None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded_state(model: torch.nn.Module, optimizer: Any, *, loading: bool) -> dict[str, Any]:
    """The model's and the optimizer's sharded state dicts, as Megatron's own training checkpoints build them."""
    ensure_adam_state(optimizer)
    model_state = model.sharded_state_dict(metadata=sharded_metadata())
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=sharded_metadata()),
    }


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    meta: dict[str, Any],
    *,
    rank: int,
    keep: int | None = None,
) -> Path:
    """All ranks call this (a collective); rank 0 publishes the directory once every rank has written its part,
    then keeps the newest ``keep`` complete checkpoints (None or 0: all)."""
    from megatron.core import dist_checkpointing

    final = _dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    check_finite(model.named_parameters(), f"step {step}: refusing to write checkpoint {final}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    _barrier()
    try:
        with quiet_dist_checkpointing():
            dist_checkpointing.save(
                _sharded_state(model, optimizer, loading=False), str(tmp), sharded_strategy=dist_backend()
            )
        _barrier()
        if rank == 0:
            (tmp / "meta.json").write_text(
                json.dumps({"format": DIST_FORMAT, "step": step, **meta, DECLARED: CHECKSUMS}, sort_keys=True, indent=1)
            )
        record_checksums(tmp)  # every rank hashes its share; rank 0 writes the record last
    except BaseException as exc:  # torch's checkpoint writer raises CheckpointException, a BaseException
        reason = None if isinstance(exc, KeyboardInterrupt | SystemExit) else _write_failure(exc)
        if reason is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left to look like a checkpoint
        previous = latest_checkpoint(run_dir)
        kept = f"the previous checkpoint {previous} is intact (resume=true continues from it)" if previous else (
            "no earlier checkpoint exists")  # fmt: skip
        raise CheckpointError(f"step {step}: writing checkpoint {final} failed: {reason}; {kept}") from exc
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = run_dir / "checkpoints" / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, run_dir / "checkpoints" / "latest")
        if keep:
            prune_checkpoints(run_dir, keep)
    _barrier()
    return final


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints (never the one ``latest`` names); return those
    removed. Each goes by a rename out of the ``step_*`` names first, so a removal cut short leaves no
    checkpoint that looks complete and is not."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least one checkpoint is kept")
    pointer = run_dir / "checkpoints" / "latest"
    latest = pointer.read_text().strip() if pointer.is_file() else None
    removed = []
    for path in complete_checkpoints(run_dir)[:-keep]:
        if path.name == latest:
            continue
        doomed = path.with_name(f".{path.name}.removing")
        os.replace(path, doomed)
        shutil.rmtree(doomed)
        removed.append(path)
    return removed


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's published checkpoints (renamed into place, with ``meta.json`` and ``checksums.json``), oldest first."""
    return _complete_in(run_dir / "checkpoints")


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
    """The way out of a damaged checkpoint: the newest complete one before it, if any, and how to resume from it
    (``latest`` names the checkpoint resume picks; a name outside ``step_*`` is never picked)."""

    def resume_from(previous: Path) -> str:
        return (
            f"to resume from it, set the damaged one aside and point latest at it (mv {damaged} "
            f"{damaged.with_name('damaged_' + damaged.name)} && echo {previous.name} > {damaged.parent / 'latest'}), "
            "then run again with resume=true"
        )

    return offer_previous(damaged, resume_from)


def verify_checkpoint(path: Path) -> None:
    """Every file of the checkpoint is the one saved (its SHA-256 recorded in ``checksums.json``); a
    :class:`CheckpointError` naming the file and offering the previous checkpoint otherwise. A collective."""
    try:
        verify_checksums(path)
    except IntegrityError as exc:
        raise CheckpointError(f"checkpoint refused: {exc}{_fallback(path)}") from None


def finished_step(path: Path, steps: int) -> int | None:
    """The step of checkpoint ``path`` when a run of ``steps`` RL steps has none left after it, else None. Its
    ``meta.json`` is checked against the recorded digest first (an edited step is refused, not believed)."""
    try:
        verify_checksums(path, [META], warn=False)
    except IntegrityError as exc:
        raise CheckpointError(f"checkpoint refused: {exc}{_fallback(path)}") from None
    step = read_checkpoint_meta(path).get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path / META} records step={step!r}, not a step number{_fallback(path)}")
    return step if step + 1 >= steps else None


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of a run checkpoint in this format; the old per-rank format is refused by name."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / 'meta.json'}: {_first_line(exc)}{_fallback(path)}") from None
    if meta.get("format") != DIST_FORMAT:
        if (path / LEGACY_RANK_FILE.format(0)).is_file():
            raise CheckpointError(
                f"checkpoint {path} is in the per-rank format (model_rank<r>.safetensors + optim_rank<r>.pt) of "
                f"earlier megatron_iso versions, which cannot be resumed; its weights still export "
                f"(iso-convert export --ckpt {path} --out DIR) and start a new run (model.init_from)"
            )
        raise CheckpointError(f"{path / 'meta.json'} names format {meta.get('format')!r}, not {DIST_FORMAT!r}")
    return meta


def _check_shapes(path: Path, state: dict[str, Any]) -> None:
    """Every tensor this model asks for is in the checkpoint with its global shape: a differing model config is
    named here, not by the storage layer's first failed read."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    try:
        stored = dist_checkpointing.load_tensors_metadata(str(path))
    except READ_ERRORS as exc:  # a damaged metadata file raises one of many types; the file is what matters
        raise CheckpointError(f"cannot read {path}: {_first_line(exc)}{_fallback(path)}") from None
    wanted: dict[str, tuple[int, ...]] = {}
    for value in nested_values(state["model"]):
        if isinstance(value, ShardedTensorFactory):
            continue  # split on save (SwiGLU fc1, GDN in_proj); their keys are checked by the load itself
        if isinstance(value, ShardedTensor):
            wanted[value.key] = tuple(value.global_shape)
    missing = sorted(k for k in wanted if k not in stored)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks tensors this model has: {missing[:5]}; the model config differs from the run "
            "that wrote it"
        )
    shapes = [f"{k} {list(stored[k].global_shape)} (model {list(s)})" for k, s in wanted.items() if
              tuple(stored[k].global_shape) != s]  # fmt: skip
    if shapes:
        raise CheckpointError(
            f"checkpoint {path} holds tensors of other shapes than this model: {', '.join(shapes[:3])}; "
            "the model config differs from the run that wrote it"
        )


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: Any, expect: dict[str, Any], *, rank: int
) -> dict[str, Any]:
    """All ranks call this (a collective): load this rank's slices of the weights and the optimizer state, after
    checking ``meta.json`` agrees with ``expect`` (contract, data identity; not the layout)."""
    from megatron.core import dist_checkpointing

    meta = read_checkpoint_meta(path)  # the format first: the per-rank one is refused by name, unhashed
    verify_checkpoint(path)  # before any value of meta.json is used: an edited step is refused here
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} was written with {key}={meta.get(key)!r}, this run has {key}={value!r}; "
                "refusing to resume (start a new out_dir or restore the original config)"
            )
    distributed = bool(getattr(getattr(optimizer, "config", None), "use_distributed_optimizer", False))
    if meta.get("use_distributed_optimizer", distributed) != distributed:
        raise CheckpointError(
            f"checkpoint {path} was written with rl.use_distributed_optimizer={not distributed}, this run has "
            f"rl.use_distributed_optimizer={distributed}; resume with the setting the run was written with"
        )
    state = _sharded_state(model, optimizer, loading=True)
    _check_shapes(path, state)
    try:
        with quiet_dist_checkpointing():
            loaded = dist_checkpointing.load(state, str(path))
    except READ_ERRORS as exc:  # a damaged shard file raises one of many types; the file is what matters
        raise CheckpointError(f"cannot read {path}: {_first_line(exc)}{_fallback(path)}") from None
    check_finite(((k, t) for k, t in loaded["model"].items() if isinstance(t, torch.Tensor)), f"checkpoint {path}")
    model.load_state_dict(loaded["model"])
    load_optimizer_state(optimizer, loaded["optimizer"])
    return meta
