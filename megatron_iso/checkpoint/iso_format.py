"""megatron_iso's checkpoint format: one safetensors file per TP rank holding that rank's Megatron
parameters (names from :func:`~megatron_iso.models.weights.megatron_shard`) except the routed
experts, one file per EP rank holding that rank's experts (MoE models only; experts are never TP-split,
so every tensor is stored once), the checkpoint's tokenizer files, and ``iso_checkpoint.json`` (the manifest: model config, layout, file list, the HF
tensor inventory and config for export, contract identities). The manifest is written last: a
directory without one is an incomplete write, not a checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
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
from megatron_iso.models.transformer_config import IsoTransformerConfig
from megatron_iso.models.weights import hf_shapes, is_expert_param, megatron_shard

MANIFEST = "iso_checkpoint.json"
FORMAT = "megatron_iso.checkpoint"
VERSION = 1


def rank_file(tp_rank: int, tp: int) -> str:
    return f"model-tp{tp_rank:02d}-of-{tp:02d}.safetensors"


def expert_file(ep_rank: int, ep: int) -> str:
    return f"experts-ep{ep_rank:02d}-of-{ep:02d}.safetensors"


def _file_shards(
    hf: Mapping[str, torch.Tensor], cfg: IsoTransformerConfig, tp: int, ep: int
) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """(manifest entry, tensors) of every file: TP rank t's non-expert parameters, EP rank e's experts."""
    for t in range(tp):
        shard = megatron_shard(hf, cfg, t, tp, 0, ep)
        yield {"tp_rank": t, "file": rank_file(t, tp)}, {n: w for n, w in shard.items() if not is_expert_param(n)}
    if cfg.num_moe_experts:
        for e in range(ep):
            shard = megatron_shard(hf, cfg, 0, tp, e, ep)
            yield {"ep_rank": e, "file": expert_file(e, ep)}, {n: w for n, w in shard.items() if is_expert_param(n)}


def expected_shards(cfg: IsoTransformerConfig, tp: int, ep: int = 1) -> dict[str, dict[str, tuple[int, ...]]]:
    """File name -> (tensor name -> shape) of a checkpoint at layout (tp, ep), by running the sharding
    rules on meta tensors (so the expectation and the writer cannot disagree)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(cfg).items()}
    return {
        entry["file"]: {n: tuple(t.shape) for n, t in shard.items()} for entry, shard in _file_shards(meta, cfg, tp, ep)
    }


def write_rank_files(
    ckpt_dir: Path, hf: Mapping[str, torch.Tensor], cfg: IsoTransformerConfig, tp: int, ep: int = 1
) -> list[dict[str, Any]]:
    files = []
    for entry, shard in _file_shards(hf, cfg, tp, ep):
        meta = {"format": "pt", "megatron_iso": FORMAT, "tp": str(tp), "ep": str(ep)}
        meta |= {key: str(value) for key, value in entry.items() if key != "file"}
        write_safetensors(ckpt_dir / entry["file"], shard, meta)
        files.append(entry)
    return files


def write_manifest(ckpt_dir: Path, manifest: Mapping[str, Any]) -> None:
    write_json(ckpt_dir / MANIFEST, {"format": FORMAT, "version": VERSION, **manifest})


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} has no {MANIFEST}: not a megatron_iso checkpoint (or an incomplete write)")
    manifest = read_json(path)
    found = manifest if isinstance(manifest, dict) else {}
    if found.get("format") != FORMAT or found.get("version") != VERSION:
        raise CheckpointFileError(
            f"{path}: format={found.get('format')!r} version={found.get('version')!r}; "
            f"supported: format={FORMAT!r} version={VERSION}"
        )
    return manifest


# The weight files of a checkpoint, whatever its layout: another layout's are stale once this one is written.
RANK_FILE_PATTERNS = ("model-tp*-of-*.safetensors", "experts-ep*-of-*.safetensors")


def remove_stale_rank_files(ckpt_dir: Path, keep: Sequence[str]) -> None:
    for pattern in RANK_FILE_PATTERNS:
        for path in ckpt_dir.glob(pattern):
            if path.name not in keep:
                path.unlink()


def checkpoint_layout(manifest: Mapping[str, Any]) -> tuple[int, int]:
    """(tp, ep) of a manifest (checkpoints written before EP existed have no ``ep``: 1)."""
    layout = manifest["layout"]
    return int(layout["tp"]), int(layout.get("ep", 1))


@dataclass
class RankShards:
    """Every (TP, EP) rank's Megatron parameters of a checkpoint, EP-major (``shards[e * tp + t]``,
    the order :func:`~megatron_iso.models.weights.hf_from_megatron_shards` takes)."""

    tp: int
    ep: int
    shards: list[dict[str, torch.Tensor]]


def _read_file(path: Path, expected: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    with open_safetensors(path) as f:
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
    return shard


def read_rank_files(ckpt_dir: str | Path, manifest: Mapping[str, Any], cfg: IsoTransformerConfig) -> RankShards:
    """Load every file the manifest lists; each tensor's presence and shape is checked against the
    sharding rules for the manifest's layout, and errors name the tensor and the file."""
    tp, ep = checkpoint_layout(manifest)
    expected = expected_shards(cfg, tp, ep)
    listed = sorted(e["file"] for e in manifest["files"])
    if listed != sorted(expected):
        raise ValueError(f"{MANIFEST} lists files {listed}; layout tp={tp}, ep={ep} needs {sorted(expected)}")
    files = {name: _read_file(Path(ckpt_dir) / name, shapes) for name, shapes in expected.items()}
    experts = [files[expert_file(e, ep)] if cfg.num_moe_experts else {} for e in range(ep)]
    # A rank's parameters are its TP file's plus its EP rank's experts (dict merges; no copies).
    shards = [files[rank_file(t, tp)] | experts[e] for e in range(ep) for t in range(tp)]
    return RankShards(tp, ep, shards)
