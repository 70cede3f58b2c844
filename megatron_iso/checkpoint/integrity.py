"""Run checkpoints that prove their integrity: a SHA-256 per file, recorded when the checkpoint is saved and checked
before it is read (resume, ``iso-convert export``, ``model.init_from``).

The record is ``checksums.json`` beside the checkpoint's files, the last file written: it lists every other file of
the directory (``meta.json`` included, so an edited step is caught like a garbled shard) with its size and digest,
and goes in through a temporary file, fsync and rename; the directory is published (renamed to ``step_<N>``) only
after it. ``meta.json`` declares it (``"checksums": "checksums.json"``), so a published checkpoint that declares it
and lacks it is refused as incomplete. A checkpoint of an earlier version declares nothing: it loads unverified,
with a one-line warning, so older runs still resume.

Hashing is split over the ranks of the world when one is up (each rank reads its share of the files, the digests
are gathered), so a large checkpoint costs each rank about 1/world of a full read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_iso.checkpoint.files import CheckpointFileError, read_json

CHECKSUMS = "checksums.json"
FORMAT = "megatron_iso.checksums/sha256-1"
META = "meta.json"
# meta.json's key declaring that the checkpoint carries CHECKSUMS (absent in checkpoints of earlier versions).
DECLARED = "checksums"
_CHUNK = 8 << 20  # bytes read at a time: memory stays flat whatever the shard size


class IntegrityError(CheckpointFileError):
    """A checkpoint whose files are not those recorded when it was saved (or whose record is missing)."""


def file_sha256(path: Path, *, sync: bool = False) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a file, read in chunks; ``sync`` also flushes it to disk (at save)."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        if sync:
            os.fsync(f.fileno())
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _files(ckpt_dir: Path) -> list[str]:
    """Every regular file under ``ckpt_dir`` but the record itself, as sorted relative POSIX paths."""
    return sorted(
        p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS
    )


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (as is without a world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _hash_shared(ckpt_dir: Path, names: Sequence[str], *, sync: bool) -> dict[str, tuple[str, int] | None]:
    """The digest of each named file (None: missing), every rank hashing every world-th file; a collective over the
    world when one is up, and every rank gets the whole result."""
    rank, world = _world()
    mine = {}
    for name in names[rank::world]:
        path = ckpt_dir / name
        mine[name] = file_sha256(path, sync=sync) if path.is_file() else None
    if world == 1:
        return mine
    parts: list[dict[str, tuple[str, int] | None]] = [{} for _ in range(world)]
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_checksums(ckpt_dir: Path) -> None:
    """Hash (and flush to disk) every file of ``ckpt_dir`` and write ``checksums.json`` last, atomically. A collective
    over the world when one is up: call it on every rank once all have written their files; rank 0 writes."""
    names = _broadcast(_files(ckpt_dir) if _world()[0] == 0 else None)
    digests = _hash_shared(ckpt_dir, names, sync=True)  # every rank has them all: every rank raises alike
    vanished = [name for name in names if digests[name] is None]
    if vanished:
        raise CheckpointFileError(f"{ckpt_dir / vanished[0]} vanished while the checkpoint was being saved")
    if _world()[0] != 0:
        return
    files = {name: {"sha256": digests[name][0], "bytes": digests[name][1]} for name in names}
    tmp = ckpt_dir / f".{CHECKSUMS}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / CHECKSUMS)
    _fsync_dir(ckpt_dir)


def declares_checksums(ckpt_dir: Path) -> bool:
    """Whether ``meta.json`` says the checkpoint was saved with ``checksums.json`` (False if it cannot be read)."""
    try:
        meta = json.loads((ckpt_dir / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get(DECLARED) == CHECKSUMS


def _read_record(ckpt_dir: Path) -> dict[str, dict[str, Any]] | None:
    """The recorded ``{file: {sha256, bytes}}``; None for a checkpoint of an earlier version (declares none)."""
    path = ckpt_dir / CHECKSUMS
    if not path.is_file():
        if declares_checksums(ckpt_dir):
            raise IntegrityError(
                f"{ckpt_dir}: {META} says the checkpoint was saved with {CHECKSUMS}, which is missing "
                "(an incomplete copy, or a file removed since)"
            )
        return None
    record = read_json(path)
    files = record.get("files") if isinstance(record, dict) and record.get("format") == FORMAT else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in files.values()
    ):
        raise IntegrityError(f"{path}: not a {FORMAT} record (damaged)")
    return files


def verify_checksums(ckpt_dir: str | Path, only: Sequence[str] | None = None, *, warn: bool = True) -> bool:
    """Check every file ``checksums.json`` lists (or those of ``only`` among them) against its recorded digest;
    raise :class:`IntegrityError` naming the first that differs (expected vs found) or is missing. A collective over
    the world when one is up (all ranks raise alike). Returns False for a checkpoint of an earlier version without a
    record (with ``warn``, a one-line warning on stderr from rank 0), True when verified."""
    ckpt_dir = Path(ckpt_dir)
    rank = _world()[0]
    try:
        files: dict[str, dict[str, Any]] | str | None = _read_record(ckpt_dir) if rank == 0 else None
    except CheckpointFileError as exc:
        files = str(exc)  # every rank raises it, after the broadcast: none waits in a collective
    files = _broadcast(files)
    if isinstance(files, str):
        raise IntegrityError(files)
    if files is None:
        if warn and rank == 0:
            print(
                f"warning: {ckpt_dir} has no {CHECKSUMS} (saved by an earlier megatron_iso version): loaded "
                "without verifying its files",
                file=sys.stderr,
            )
        return False
    if only is not None:
        files = {name: files[name] for name in only if name in files}
    found = _hash_shared(ckpt_dir, sorted(files), sync=False)
    bad = [name for name in sorted(files) if found[name] is None or found[name][0] != files[name]["sha256"]]
    if bad:
        name = bad[0]
        expected = files[name]["sha256"]
        got = "the file is missing" if found[name] is None else f"found {found[name][0]} ({found[name][1]} bytes)"
        more = f" ({len(bad) - 1} more file(s) differ: {', '.join(bad[1:4])})" if len(bad) > 1 else ""
        raise IntegrityError(
            f"{ckpt_dir / name} is not the file saved: expected SHA-256 {expected} ({files[name].get('bytes')} "
            f"bytes), {got}{more}"
        )
    return True


def complete_checkpoints(root: Path) -> list[Path]:
    """The published checkpoints ``root/step_*`` (renamed into place: ``meta.json``, and ``checksums.json`` where
    ``meta.json`` declares it), oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.glob("step_*")
        if not p.name.endswith(".tmp")
        and (p / META).is_file()
        and ((p / CHECKSUMS).is_file() or not declares_checksums(p))
    )


def previous_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint saved before ``ckpt_dir`` in the same run (None: there is none)."""
    earlier = [p for p in complete_checkpoints(ckpt_dir.parent) if p.name < ckpt_dir.name]
    return earlier[-1] if earlier else None


def offer_previous(ckpt_dir: Path, use: Callable[[Path], str]) -> str:
    """The way out of a refused checkpoint, as a clause to append: the previous complete one and ``use(it)``, the
    command or setting that uses it."""
    previous = previous_checkpoint(ckpt_dir) if ckpt_dir.name.startswith("step_") else None
    if previous is None:
        return "; no earlier complete checkpoint exists"
    return f"; the newest complete checkpoint before it is {previous}: {use(previous)}"


__all__ = [
    "CHECKSUMS",
    "DECLARED",
    "IntegrityError",
    "complete_checkpoints",
    "declares_checksums",
    "file_sha256",
    "offer_previous",
    "previous_checkpoint",
    "record_checksums",
    "verify_checksums",
]
