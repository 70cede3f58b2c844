"""The checkpoint's own tokenizer: its files travel with every conversion and load from disk only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_iso.checkpoint.files import copy_file

# Files an HF model directory may carry besides weights and config.json that text tasks need.
ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_assets(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer/generation files present in ``src`` to ``dst``; return their names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in ASSET_FILES:
        if (src / name).is_file():
            copy_file(src / name, dst / name)
            copied.append(name)
    return copied


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer stored in ``model_dir`` (an HF directory or a megatron_iso checkpoint), through
    transformers' AutoTokenizer from local files only: nothing is fetched from a hub."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise FileNotFoundError(
            f"{model_dir} has no tokenizer files (looked for tokenizer.json, tokenizer_config.json, vocab.json)"
        )
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
