"""HF model directories: weights in safetensors (one file, or shards listed by
``model.safetensors.index.json``) plus ``config.json``. Read and written with ``safetensors`` only
(never pickle)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_iso.checkpoint.files import (
    CheckpointFileError,
    open_safetensors,
    read_json,
    write_json,
    write_safetensors,
)
from megatron_iso.checkpoint.hf_config import HF_CONFIG_FILE

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Every weight file an HF directory may hold: a new export's replace all of a previous one's.
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE, "model-*-of-*.safetensors")
# HF's loaders check this header entry.
HF_METADATA = {"format": "pt"}


def _read_file(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    out = {}
    with open_safetensors(path) as f:
        present = set(f.keys())
        for name in names if names is not None else sorted(present):
            if name not in present:
                raise KeyError(f"tensor '{name}' is listed in {INDEX_FILE} but missing from {path.name}")
            out[name] = f.get_tensor(name)
    return out


def read_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors directory, by name (single file or sharded)."""
    hf_dir = Path(hf_dir)
    if (hf_dir / INDEX_FILE).is_file():
        index = read_json(hf_dir / INDEX_FILE)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointFileError(f"{hf_dir / INDEX_FILE}: no 'weight_map' object (tensor name -> file)")
        by_file: dict[str, list[str]] = {}
        for name, file in index["weight_map"].items():
            by_file.setdefault(file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, names in sorted(by_file.items()):
            out |= _read_file(hf_dir / file, sorted(names))
        return out
    if (hf_dir / SINGLE_FILE).is_file():
        return _read_file(hf_dir / SINGLE_FILE)
    if list(hf_dir.glob("*.bin")) or list(hf_dir.glob("*.pt")):
        raise ValueError(f"{hf_dir} holds pickled weights (*.bin/*.pt); only safetensors are read (no pickle)")
    raise FileNotFoundError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _shard_groups(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names per output file, in name order, each file up to ``max_shard_bytes`` (a tensor
    larger than the limit gets a file of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if max_shard_bytes is not None and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_hf_dir(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``config.json`` and the weights (sharded with an index when ``max_shard_bytes`` splits
    them); return the weight file names. Files are replaced atomically, the index/config last."""
    out_dir = Path(out_dir)
    groups = _shard_groups(tensors, max_shard_bytes)
    if len(groups) == 1:
        write_safetensors(out_dir / SINGLE_FILE, tensors, HF_METADATA)
        files = [SINGLE_FILE]
        (out_dir / INDEX_FILE).unlink(missing_ok=True)
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        weight_map = {}
        for file, names in zip(files, groups, strict=True):
            write_safetensors(out_dir / file, {n: tensors[n] for n in names}, HF_METADATA)
            weight_map |= dict.fromkeys(names, file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        (out_dir / SINGLE_FILE).unlink(missing_ok=True)
    write_json(out_dir / HF_CONFIG_FILE, dict(config))
    return files
