"""Atomic file writes: a reader sees the old file or the complete new one, never a torn write."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


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
