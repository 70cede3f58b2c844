"""Checkpoint file I/O. Writes are atomic: a reader sees the old file or the complete new one, never a torn
write. Reads of files that are not what they claim (a truncated or corrupted safetensors file, a damaged JSON
index or manifest) raise :class:`CheckpointFileError` naming the file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
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


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8"))


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    # safetensors refuses views sharing storage with other entries; a contiguous clone owns its bytes.
    owned = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    _atomic(path, lambda tmp: save_file(owned, str(tmp), metadata=dict(metadata)))


def copy_file(src: Path, dst: Path) -> None:
    _atomic(dst, lambda tmp: shutil.copyfile(src, tmp))
