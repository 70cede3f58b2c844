"""The text model's HF tensor names: what a checkpoint stores vs what megatron_iso's model reads (a multimodal
Qwen3.5 keeps its text model under ``model.language_model.`` and ships a vision tower and an MTP head)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from megatron_iso.checkpoint.hf_config import QWEN3_5_VL_TEXT_TYPES, is_multimodal

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# A multimodal Qwen3.5 checkpoint keeps its text model under this prefix (transformers' PrefixChange).
VL_TEXT_PREFIX = "model.language_model."
# Qwen3.5 tensors the causal LM's logits never read (the vision tower, the multi-token-prediction
# head); transformers' Qwen3_5(Moe)ForCausalLM ignores them on load, and so does import.
_QWEN3_5_UNUSED = ("model.visual.", "mtp.")
_QWEN3_5_TYPES = {*QWEN3_5_VL_TEXT_TYPES, *QWEN3_5_VL_TEXT_TYPES.values()}


def text_model_names(
    names: Iterable[str], hf_config: Mapping[str, Any] | None
) -> tuple[dict[str, str], tuple[str, ...]]:
    """The text model's tensor names -> their stored names, and the stored names dropped as unused."""
    names = list(names)
    if hf_config is None or hf_config.get("model_type") not in _QWEN3_5_TYPES:
        return {n: n for n in names}, ()
    dropped = tuple(sorted(n for n in names if n.startswith(_QWEN3_5_UNUSED)))
    kept = [n for n in names if not n.startswith(_QWEN3_5_UNUSED)]
    if not is_multimodal(hf_config):
        return {n: n for n in kept}, dropped
    return {("model." + n[len(VL_TEXT_PREFIX) :] if n.startswith(VL_TEXT_PREFIX) else n): n for n in kept}, dropped
