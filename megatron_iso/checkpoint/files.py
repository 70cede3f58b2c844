"""Checkpoint file I/O. Writes are atomic: a reader sees the old file or the complete new one, never a torn
write; files get the mode the umask gives (0644 under the usual 022), as any tool's output would. Reads of files
that are not what they claim (a truncated or corrupted safetensors file, a damaged JSON index or manifest) raise
:class:`CheckpointFileError` naming the file. A converter's output directory is checked before anything is written
(:func:`check_output_dir`) and built in a temporary sibling (:func:`staged_output`): a refused command leaves none."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_iso.errors import UserError


class CheckpointFileError(UserError, ValueError):
    """A checkpoint or HF weight file that cannot be read as what it claims to be; the message names the file."""


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open(path)`` on the CPU; a missing, truncated or corrupted file is a :class:`CheckpointFileError`."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as exc:
        raise CheckpointFileError(f"{path}: not a readable safetensors file (truncated or corrupted? {exc})") from exc
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: no such file") from None


def read_json(path: Path) -> Any:
    """A JSON file's content; a file that is not UTF-8 JSON is a :class:`CheckpointFileError` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFileError(f"{path}: not valid JSON ({exc})") from exc


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    # Created with mode 0666 so the kernel applies the umask, as for any new file (mkstemp's 0600 made exported
    # weights unreadable to other users); set again after the write, as safetensors replaces the file with a 0600 one.
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    mode = tmp.stat().st_mode & 0o777
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8"))


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    # safetensors refuses views sharing storage with other entries; a contiguous clone owns its bytes.
    owned = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    _atomic(path, lambda tmp: save_file(owned, str(tmp), metadata=dict(metadata)))


def copy_file(src: Path, dst: Path) -> None:
    _atomic(dst, lambda tmp: shutil.copyfile(src, tmp))


# What marks a directory as a training run's (rl.run_dir): its metrics log, or its checkpoints' latest pointer.
_RUN_DIR_MARKERS = ("metrics.jsonl", "checkpoints/latest")


def enclosing_run_dir(path: Path) -> Path | None:
    """The training run directory ``path`` is, or lies inside; None if none."""
    for candidate in (path, *path.parents):
        if any((candidate / marker).is_file() for marker in _RUN_DIR_MARKERS):
            return candidate
    return None


def check_input_dir(path: Path, flag: str) -> None:
    """A converter's input directory exists: "no such directory" says so, before any format is guessed."""
    if not path.exists():
        raise CheckpointFileError(f"{flag}: no such directory: {path}")
    if not path.is_dir():
        raise CheckpointFileError(f"{flag}: {path} is a file, not a directory")


def check_output_dir(out: Path, source: Path, flag: str = "--out") -> None:
    """Refuse, before anything is written, an output directory that is the source, lies inside it, is a file, or is
    (or lies inside) a training run's directory, whose files belong to the run."""
    resolved, src = out.resolve(), source.resolve()
    if resolved == src or src in resolved.parents:
        where = "is the source directory itself" if resolved == src else f"lies inside the source {source}"
        raise CheckpointFileError(f"{flag} {out} {where}; write the output to another directory")
    if resolved.exists() and not resolved.is_dir():
        raise CheckpointFileError(f"{flag} {out} is a file, not a directory")
    run = enclosing_run_dir(resolved)
    if run is not None:
        where = "is the training run directory" if run == resolved else f"lies inside the training run directory {run}"
        raise CheckpointFileError(
            f"{flag} {out} {where} (it holds metrics.jsonl or checkpoints/latest); write the output outside it"
        )


@contextlib.contextmanager
def staged_output(out: Path, *, replaces: Sequence[str] = (), marker: str | None = None) -> Iterator[Path]:
    """A directory to build ``out``'s files in: a temporary sibling, renamed to ``out`` when the block succeeds and
    removed (with any parent directory made for it) when it fails, so a refused or failed command leaves no output.

    An ``out`` that already exists keeps its other files: the new files are moved in one by one (``marker``, the
    file whose presence says the output is whole, is removed first and moved in last), then the files matching the
    ``replaces`` globs that the new output lacks (a previous output's other shards) are removed."""
    made = next((p for p in (*reversed(out.parents), out) if not p.exists()), None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(out)
    tmp.mkdir()  # plain mkdir, not mkdtemp (0700): the umask decides, as for the files
    try:
        yield tmp
        if not out.exists() or (out.is_dir() and not any(out.iterdir())):
            os.replace(tmp, out)
            return
        new = sorted(p.name for p in tmp.iterdir())
        if marker is not None:
            (out / marker).unlink(missing_ok=True)
        for name in sorted(new, key=lambda n: n == marker):
            os.replace(tmp / name, out / name)
        for pattern in replaces:
            for stale in out.glob(pattern):
                if stale.name not in new:
                    stale.unlink()
    except BaseException:
        if made is not None and made != out:
            shutil.rmtree(made, ignore_errors=True)  # only what this call made: the parents of out, and tmp in them
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
