"""Tiny random HF Qwen3 / Qwen3-MoE / Qwen3-Next models written by transformers itself (the external
reference)."""

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
# Qwen3-MoE: 4 experts, top-2, HF's default norm_topk_prob=False (Megatron's pre-softmax routing).
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False)
# Qwen3-Next: layers [GDN, gated attention], partial RoPE, zero-centred norms, 4 experts + gated shared expert.
TINY_NEXT = dict(
    TINY,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    layer_types=["linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
)
# Qwen3.5 text: Qwen3-Next's blocks with GDN's projections stored flat (in_proj_qkv/z/b/a); dense MLP.
TINY_QWEN3_5 = {
    k: v
    for k, v in TINY_NEXT.items()
    if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
}
# Qwen3.5-MoE text: no intermediate_size (every layer MoE), router always renormalises the top-k.
TINY_QWEN3_5_MOE = {k: v for k, v in TINY_NEXT.items() if k != "intermediate_size"}
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", TINY),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_MOE),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", TINY_NEXT),
    # num_experts=0: HF's Qwen3-Next with a dense MLP in every layer (our tiny_hybrid).
    "qwen3_next_dense": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(TINY_NEXT, num_experts=0)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", TINY_QWEN3_5),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", TINY_QWEN3_5_MOE),
}
# Multimodal wrappers (how Qwen3.5 ships): text model under model.language_model., plus a vision tower.
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4)
VL_FAMILIES = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}
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
    family: str = "qwen3",
    multimodal: bool = False,
) -> Path:
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs, tie_word_embeddings=tied)
    if multimodal:
        config_cls, model_cls = VL_FAMILIES[family]
        config = getattr(transformers, config_cls)(
            text_config=config.to_dict(), vision_config=TINY_VISION, tie_word_embeddings=tied
        )
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in model.parameters():  # (GDN's A_log / dt_bias are 1-d too: perturbed alike)
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


@pytest.fixture(scope="session")
def hf_moe(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_moe"), family="qwen3_moe", seed=4)


@pytest.fixture(scope="session")
def hf_next(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_next"), family="qwen3_next", seed=5)


@pytest.fixture(scope="session")
def hf_next_dense(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_next_dense"), family="qwen3_next_dense", seed=6)


@pytest.fixture(scope="session")
def hf_qwen3_5(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_qwen3_5"), family="qwen3_5", seed=7)


@pytest.fixture(scope="session")
def hf_qwen3_5_moe(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_qwen3_5_moe"), family="qwen3_5_moe", seed=8)


@pytest.fixture(scope="session")
def hf_qwen3_5_vl(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_qwen3_5_vl"), family="qwen3_5", multimodal=True, seed=9)


@pytest.fixture(scope="session")
def hf_qwen3_5_moe_vl(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf_qwen3_5_moe_vl"), family="qwen3_5_moe", multimodal=True, seed=10)
