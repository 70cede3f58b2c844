"""megatron_iso's checkpoint format: one safetensors file per TP rank holding that rank's Megatron
parameters (names from :func:`~megatron_iso.models.weights.megatron_shard`), the checkpoint's
tokenizer files, and ``iso_checkpoint.json`` (the manifest: model config, layout, file list, the HF
tensor inventory and config for export, contract identities). The manifest is written last: a
directory without one is an incomplete write, not a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megatron_iso.checkpoint.files import write_json, write_safetensors
from megatron_iso.models.config import IsoTransformerConfig
from megatron_iso.models.weights import hf_shapes, megatron_shard

MANIFEST = "iso_checkpoint.json"
FORMAT = "megatron_iso.checkpoint"
VERSION = 1


def rank_file(tp_rank: int, tp: int) -> str:
    return f"model-tp{tp_rank:02d}-of-{tp:02d}.safetensors"


def expected_shards(cfg: IsoTransformerConfig, tp: int) -> list[dict[str, tuple[int, ...]]]:
    """Name -> shape of every rank's parameters, by running the sharding rules on meta tensors
    (so the expectation and the writer cannot disagree)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(cfg).items()}
    return [{n: tuple(t.shape) for n, t in megatron_shard(meta, cfg, r, tp).items()} for r in range(tp)]


def write_rank_files(
    ckpt_dir: Path, hf: Mapping[str, torch.Tensor], cfg: IsoTransformerConfig, tp: int
) -> list[dict[str, Any]]:
    files = []
    for r in range(tp):
        name = rank_file(r, tp)
        meta = {"format": "pt", "megatron_iso": FORMAT, "tp_rank": str(r), "tp": str(tp)}
        write_safetensors(ckpt_dir / name, megatron_shard(hf, cfg, r, tp), meta)
        files.append({"tp_rank": r, "file": name})
    return files


def write_manifest(ckpt_dir: Path, manifest: Mapping[str, Any]) -> None:
    write_json(ckpt_dir / MANIFEST, {"format": FORMAT, "version": VERSION, **manifest})


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} has no {MANIFEST}: not a megatron_iso checkpoint (or an incomplete write)")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{path}: format={manifest.get('format')!r} version={manifest.get('version')!r}; "
            f"supported: format={FORMAT!r} version={VERSION}"
        )
    return manifest


def remove_stale_rank_files(ckpt_dir: Path, keep: Sequence[str]) -> None:
    for path in ckpt_dir.glob("model-tp*-of-*.safetensors"):
        if path.name not in keep:
            path.unlink()


@dataclass
class RankShards:
    """Every TP rank's Megatron parameters of a checkpoint, in rank order."""

    tp: int
    shards: list[dict[str, torch.Tensor]]


def read_rank_files(ckpt_dir: str | Path, manifest: Mapping[str, Any], cfg: IsoTransformerConfig) -> RankShards:
    """Load every rank file the manifest lists; each tensor's presence and shape is checked against
    the sharding rules for the manifest's layout, and errors name the tensor and the file."""
    tp = int(manifest["layout"]["tp"])
    entries = sorted(manifest["files"], key=lambda e: e["tp_rank"])
    if [e["tp_rank"] for e in entries] != list(range(tp)):
        raise ValueError(f"{MANIFEST} lists TP ranks {[e['tp_rank'] for e in entries]}, expected 0..{tp - 1}")
    shards = []
    for entry, expected in zip(entries, expected_shards(cfg, tp), strict=True):
        path = Path(ckpt_dir) / entry["file"]
        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            for name, shape in expected.items():
                if name not in present:
                    raise KeyError(f"{path.name} is missing tensor '{name}' (expected shape {list(shape)})")
            extra = sorted(present - set(expected))
            if extra:
                raise KeyError(f"{path.name} has unexpected tensors {extra}")
            shard = {name: f.get_tensor(name) for name in expected}
        for name, shape in expected.items():
            if tuple(shard[name].shape) != shape:
                raise ValueError(
                    f"{path.name}: tensor '{name}' has shape {list(shard[name].shape)}, expected {list(shape)}"
                )
        shards.append(shard)
    return RankShards(tp, shards)
