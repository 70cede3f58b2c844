"""Tiny random HF Qwen3 models written by transformers itself (the external reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    # Larger than HF's 0.02 so logits are O(1) and a wrong weight mapping shows plainly.
    initializer_range=0.1,
)
WORDS = ["hello", "world", "the", "policy", "moved", "not", "runtime"]


def save_tiny_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(out))


def make_hf_model(
    out: Path,
    *,
    tied: bool = False,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    tokenizer: bool = False,
    seed: int = 0,
) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=tied))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms are initialised to exactly 1; perturb them so a swapped norm shows
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    if tokenizer:
        save_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_untied"), tokenizer=True)


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_tied"), tied=True, seed=1)


@pytest.fixture(scope="session")
def hf_sharded(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_sharded"), max_shard_size="40KB", seed=2)


@pytest.fixture(scope="session")
def hf_bf16(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_bf16"), dtype=torch.bfloat16, seed=3)
