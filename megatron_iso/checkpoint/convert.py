"""HF directory -> megatron_iso checkpoint (any TP/EP layout) -> HF directory, bit for bit.

The full HF-named state dict is the pivot: import shards it with
:func:`~megatron_iso.models.weights.megatron_shard`, export gathers it back with
:func:`~megatron_iso.models.weights.hf_from_megatron_shards`; tensors keep their stored dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_iso.checkpoint import iso_format
from megatron_iso.checkpoint.files import check_input_dir, check_output_dir, staged_output
from megatron_iso.checkpoint.hf_config import (
    HF_CONFIG_FILE,
    hf_config_from_model,
    model_config_from_hf,
    read_hf_config,
    text_model_hf_config,
)
from megatron_iso.checkpoint.hf_dir import WEIGHT_FILES, read_hf_weights, write_hf_dir
from megatron_iso.checkpoint.names import EMBED, LM_HEAD, text_model_names
from megatron_iso.checkpoint.tokenizer import copy_assets
from megatron_iso.models.transformer_config import IsoTransformerConfig, transformer_config
from megatron_iso.models.weights import (
    check_hf_state_dict,
    fuse_experts,
    hf_from_megatron_shards,
    hf_shapes,
    split_fused_experts,
)
from megatron_iso.settings import Settings, contract_for, settings_with_model


@dataclass
class HFWeights:
    """A checked HF state dict plus how the source stored it (for a faithful export)."""

    tensors: dict[str, torch.Tensor]
    tied_lm_head_stored: bool  # a tied model whose files also carry lm_head.weight (== embeddings)
    fused_experts: bool = False  # experts stored as 3-D mlp.experts.gate_up_proj / down_proj
    dropped: tuple[str, ...] = ()  # stored tensors the text model does not use (vision tower, MTP head)


def _text_model_tensors(
    tensors: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any] | None
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The text model's tensors under their text-model names, and the names dropped as unused."""
    names, dropped = text_model_names(tensors, hf_config)
    return {name: tensors[stored] for name, stored in names.items()}, dropped


def checked_hf_weights(
    tensors: Mapping[str, torch.Tensor], cfg: IsoTransformerConfig, hf_config: Mapping[str, Any] | None = None
) -> HFWeights:
    """Every expected tensor present with its shape and nothing else; errors name the tensor.

    ``hf_config`` (the directory's config.json) says how the tensors are stored: a multimodal
    Qwen3.5's text model is read from under ``model.language_model.``; its vision tower and MTP head
    are dropped. Fused 3-D experts are split per expert in every family."""
    tensors, dropped = _text_model_tensors(tensors, hf_config)
    tensors, fused = split_fused_experts(tensors)
    tied_stored = False
    if cfg.tie_word_embeddings and LM_HEAD in tensors and EMBED in tensors:
        # Some tied checkpoints store the head anyway; accept it only as an exact copy.
        if tensors[LM_HEAD].shape != tensors[EMBED].shape or not torch.equal(tensors[LM_HEAD], tensors[EMBED]):
            raise ValueError(f"tensor '{LM_HEAD}' differs from '{EMBED}' but config.json has tie_word_embeddings=true")
        del tensors[LM_HEAD]
        tied_stored = True
    check_hf_state_dict(tensors, cfg)
    unexpected = sorted(set(tensors) - set(hf_shapes(cfg)))
    if unexpected:
        raise KeyError(f"checkpoint has unexpected tensors {unexpected} that this model config does not describe")
    return HFWeights(tensors, tied_stored, fused, dropped)


def hf_dir_settings(hf_dir: str | Path, overrides: Sequence[str] = ()) -> Settings:
    """The root config's settings with ``model`` derived from the HF directory's config.json."""
    hf_dir = Path(hf_dir)
    model = model_config_from_hf(read_hf_config(hf_dir), name=hf_dir.resolve().name)
    return settings_with_model(model, overrides)


def _identities(settings: Settings) -> dict[str, Any]:
    return contract_for(settings).identities.to_dict()


def import_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int | None = None,
    overrides: Sequence[str] = (),
    ep: int | None = None,
) -> dict[str, Any]:
    """Convert an HF safetensors directory into a megatron_iso checkpoint at layout TP=``tp``,
    EP=``ep`` (defaults: ``parallel.tp`` / ``parallel.ep`` of the config); return the manifest."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_input_dir(hf_dir, "--hf")
    check_output_dir(out_dir, hf_dir)
    layout = [*([f"parallel.tp={tp}"] if tp is not None else []), *([f"parallel.ep={ep}"] if ep is not None else [])]
    settings = hf_dir_settings(hf_dir, [*overrides, *layout])
    tc = transformer_config(settings)
    tp, ep = tc.tensor_model_parallel_size, settings.parallel.ep
    iso_format.expected_shards(tc, tp, ep)  # a layout the model cannot take fails before anything is written
    identities = _identities(settings)  # so does a config without a contract (e.g. a bad profile override)
    weights = checked_hf_weights(read_hf_weights(hf_dir), tc, read_hf_config(hf_dir))
    # Built aside and moved in, the manifest last (and first removed from an existing checkpoint): readers see an
    # incomplete checkpoint, never a mixed one, and a failed import leaves no output.
    with staged_output(out_dir, replaces=iso_format.RANK_FILE_PATTERNS, marker=iso_format.MANIFEST) as staging:
        manifest = _write_import(staging, hf_dir, settings, tc, tp, ep, weights, identities)
    return manifest


def _write_import(
    out_dir: Path,
    hf_dir: Path,
    settings: Settings,
    tc: IsoTransformerConfig,
    tp: int,
    ep: int,
    weights: HFWeights,
    identities: dict[str, Any],
) -> dict[str, Any]:
    files = iso_format.write_rank_files(out_dir, weights.tensors, tc, tp, ep)
    assets = copy_assets(hf_dir, out_dir)
    manifest = {
        "model": dict(settings.config["model"]),
        "layout": {"tp": tp, "ep": ep},
        "files": files,
        "assets": assets,
        "hf": {
            "config": read_hf_config(hf_dir),
            "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype)} for n, t in sorted(weights.tensors.items())},
            "tied_lm_head_stored": weights.tied_lm_head_stored,
            "fused_experts": weights.fused_experts,
            "dropped_tensors": list(weights.dropped),
        },
        "identities": identities,
        "source": str(hf_dir.resolve()),
    }
    iso_format.write_manifest(out_dir, manifest)
    return manifest


def checkpoint_settings(ckpt_dir: str | Path, overrides: Sequence[str] = ()) -> Settings:
    """The root config's settings with ``model`` from a megatron_iso checkpoint's manifest."""
    return settings_with_model(iso_format.read_manifest(ckpt_dir)["model"], overrides)


def load_checkpoint_hf(ckpt_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest, full HF-named state dict) of a checkpoint in any TP/EP layout; pass the state dict
    to ``build_model`` to load it into a model of any other layout."""
    manifest = iso_format.read_manifest(ckpt_dir)
    tp, ep = iso_format.checkpoint_layout(manifest)
    tc = transformer_config(settings_with_model(manifest["model"], [f"parallel.tp={tp}", f"parallel.ep={ep}"]))
    ranks = iso_format.read_rank_files(ckpt_dir, manifest, tc)
    return manifest, hf_from_megatron_shards(ranks.shards, tc, ranks.ep)


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, max_shard_bytes: int | None = None) -> list[str]:
    """Write a megatron_iso checkpoint (``iso-convert import``'s, or a run's ``checkpoints/step_N``) back as an HF
    directory (config.json, safetensors, tokenizer files); return the weight file names. A run checkpoint's files
    are checked against their recorded SHA-256 first. The output is built in a temporary sibling and renamed into
    place: a refusal leaves no output directory (an existing one keeps its files)."""
    from megatron_iso.checkpoint.run_ckpt import export_run_checkpoint, is_run_checkpoint, verify_run_checkpoint

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    check_input_dir(ckpt_dir, "--ckpt")
    check_output_dir(out_dir, ckpt_dir)
    run = not (ckpt_dir / iso_format.MANIFEST).is_file() and is_run_checkpoint(ckpt_dir)
    if run:
        verify_run_checkpoint(ckpt_dir, lambda p: f"export it instead: iso-convert export --ckpt {p} --out {out_dir}")
    with staged_output(out_dir, replaces=WEIGHT_FILES, marker=HF_CONFIG_FILE) as staging:
        if run:
            return export_run_checkpoint(ckpt_dir, staging, max_shard_bytes, check=False)
        return _export_iso(ckpt_dir, staging, max_shard_bytes)


def _export_iso(ckpt_dir: Path, out_dir: Path, max_shard_bytes: int | None) -> list[str]:
    manifest, hf = load_checkpoint_hf(ckpt_dir)
    source = manifest.get("hf") or {}
    if source.get("tied_lm_head_stored"):
        hf[LM_HEAD] = hf[EMBED]
    for name, spec in (source.get("tensors") or {}).items():
        if name not in hf:
            raise KeyError(f"exported state lacks tensor '{name}' recorded in the manifest")
        if list(hf[name].shape) != spec["shape"] or str(hf[name].dtype) != spec["dtype"]:
            raise ValueError(
                f"tensor '{name}': {list(hf[name].shape)} {hf[name].dtype} != manifest {spec['shape']} {spec['dtype']}"
            )
    if source.get("fused_experts"):
        hf = fuse_experts(hf, transformer_config(settings_with_model(manifest["model"])))
    # A multimodal source exports as its text model (the vision tower was not imported).
    config = text_model_hf_config(source["config"]) if source.get("config") else hf_config_from_model(manifest["model"])
    files = write_hf_dir(out_dir, hf, config, max_shard_bytes)
    copy_assets(ckpt_dir, out_dir)
    return files
