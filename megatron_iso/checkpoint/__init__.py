"""Checkpoints: HF safetensors directories <-> megatron_iso's per-TP-rank format, tokenizer files,
and the logits comparison against HF transformers (docs/CHECKPOINTS.md)."""

from megatron_iso.checkpoint.convert import (
    checked_hf_weights,
    checkpoint_settings,
    export_hf,
    hf_dir_settings,
    import_hf,
    load_checkpoint_hf,
)
from megatron_iso.checkpoint.hf_dir import read_hf_weights, write_hf_dir
from megatron_iso.checkpoint.tokenizer import copy_assets, load_tokenizer

__all__ = [
    "checked_hf_weights",
    "checkpoint_settings",
    "copy_assets",
    "export_hf",
    "hf_dir_settings",
    "import_hf",
    "load_checkpoint_hf",
    "load_tokenizer",
    "read_hf_weights",
    "write_hf_dir",
]
