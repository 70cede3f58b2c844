"""From the Hydra config (model, profile, parallel) to Megatron's TransformerConfig.

:class:`IsoTransformerConfig` is Megatron's config plus the few fields megatron_iso's layers read;
they are dataclass fields (not attributes patched on later) so a reader sees them in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_iso.contract.build import resolve_device_class
from megatron_iso.ops.gdn import check_backward_states, gdn_profile_fields

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROFILES = ("correctness", "performance")


@dataclass
class IsoTransformerConfig(TransformerConfig):
    iso_profile: str = "correctness"  # correctness = invariant ops; performance = stock ops
    iso_leaves: int = 8  # leaves of row-parallel GEMMs and of the vocab log-sum-exp
    iso_column_leaves: int = 1  # column-parallel GEMMs never split K across ranks
    iso_expert_leaves: int = 1  # routed experts' down projection: expert TP is 1, K never split
    iso_kv_block: int = 64  # attention reduces keys in blocks of this many positions
    rope_theta: float = 1_000_000.0
    rotary_fraction: float = 1.0  # share of head_dim rotated (Qwen3-Next: 0.25)
    vocab_size: int = 0
    max_sequence_length: int = 0
    tie_word_embeddings: bool = False
    iso_gdn_chunk: int = 64  # CPR chunk of the Gated DeltaNet layers (profile.gdn_chunk)
    iso_gdn_form: str = "scan"  # GDN output form on the GPU (profile.gdn_form resolved: scan or chunk)
    iso_gdn_dot_precision: str | None = None  # GDN kernels' dot precision on the GPU (profile.gdn_dot_precision)
    iso_gdn_backward_states: str = "keep"  # what a GPU GDN forward keeps for the backward (rl.gdn_backward_states)
    # How HF checkpoints store GDN's input projections (model.hf_gdn_layout; naming only, same computation):
    # "qkvz" = Qwen3-Next's in_proj_qkvz/in_proj_ba grouped per key head, "split" = Qwen3.5's flat in_proj_qkv/z/b/a.
    hf_gdn_layout: str = "qkvz"


HF_GDN_LAYOUTS = ("qkvz", "split")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def is_hybrid(model: Any) -> bool:
    """Whether ``model`` interleaves Gated DeltaNet layers with full attention (it sets ``full_attention_interval``)."""
    return _get(model, "full_attention_interval") is not None


def gdn_fields(model: Any, profile: Any, rl: Any, device_class: str) -> dict[str, Any]:
    """Megatron's Gated DeltaNet fields (``experimental_attention_variant``, ``linear_*``) for a hybrid
    model (one with ``full_attention_interval``); empty otherwise. Every ``full_attention_interval``-th
    layer is full attention (Megatron's ``linear_attention_freq``, HF's ``layer_types``). ``rl``: the trainer's
    group, for ``rl.gdn_backward_states`` (default "keep"). ``device_class`` resolves ``profile.gdn_form=auto``."""
    if not is_hybrid(model):
        return {}
    interval = _get(model, "full_attention_interval")
    if int(interval) < 1:
        raise ValueError(f"model.full_attention_interval={interval} must be >= 1")
    chunk = int(_get(profile, "gdn_chunk", 64))
    if chunk < 1:
        raise ValueError(f"profile.gdn_chunk={chunk} must be a positive int")
    form, precision = gdn_profile_fields(profile, device_class)
    backward_states = check_backward_states(str(_get(rl, "gdn_backward_states", "keep")), "rl.gdn_backward_states")
    layout = str(_get(model, "hf_gdn_layout", "qkvz"))
    if layout not in HF_GDN_LAYOUTS:
        raise ValueError(f"model.hf_gdn_layout={layout!r} is not allowed; allowed values: {list(HF_GDN_LAYOUTS)}")
    return {
        "experimental_attention_variant": "gated_delta_net",
        "hf_gdn_layout": layout,
        "linear_attention_freq": int(interval),
        "linear_conv_kernel_dim": int(model.linear_conv_kernel_dim),
        "linear_key_head_dim": int(model.linear_key_head_dim),
        "linear_value_head_dim": int(model.linear_value_head_dim),
        "linear_num_key_heads": int(model.linear_num_key_heads),
        "linear_num_value_heads": int(model.linear_num_value_heads),
        "iso_gdn_chunk": chunk,
        "iso_gdn_form": form,
        "iso_gdn_dot_precision": precision,
        "iso_gdn_backward_states": backward_states,
    }


def transformer_config(cfg: Any) -> IsoTransformerConfig:
    """Build the Megatron config for ``cfg.model`` under ``cfg.profile`` and ``cfg.parallel``."""
    model, profile, parallel = cfg.model, cfg.profile, cfg.parallel
    name = str(profile.name)
    if name not in PROFILES:
        raise ValueError(f"profile.name={name!r} is not allowed; allowed values: {list(PROFILES)}")
    dtype_name = str(_get(model, "params_dtype", "fp32"))
    if dtype_name not in DTYPES:
        raise ValueError(f"model.params_dtype={dtype_name!r} is not allowed; allowed values: {sorted(DTYPES)}")
    dtype = DTYPES[dtype_name]
    tp = int(_get(parallel, "tp", 1))
    return IsoTransformerConfig(
        **gdn_fields(model, profile, _get(cfg, "rl"), resolve_device_class(str(_get(cfg, "device", "auto")))),
        **moe_fields(model, parallel),
        num_layers=int(model.num_layers),
        hidden_size=int(model.hidden_size),
        ffn_hidden_size=int(model.ffn_hidden_size),
        num_attention_heads=int(model.num_attention_heads),
        num_query_groups=int(model.num_query_groups),
        kv_channels=int(model.kv_channels),
        normalization="RMSNorm",
        layernorm_epsilon=float(model.norm_epsilon),
        layernorm_zero_centered_gamma=bool(_get(model, "zero_centered_norm", False)),
        qk_layernorm=bool(_get(model, "qk_layernorm", True)),
        attention_output_gate=bool(_get(model, "attention_output_gate", False)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=int(_get(parallel, "pp", 1)),
        sequence_parallel=bool(_get(parallel, "sp", False)) and tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        init_method_std=float(_get(model, "init_std", 0.02)),
        iso_profile=name,
        iso_leaves=int(_get(profile, "leaves", 8)) if name == "correctness" else 1,
        iso_expert_leaves=int(_get(profile, "expert_leaves", 1)) if name == "correctness" else 1,
        iso_kv_block=int(_get(profile, "attention_kv_block", 64)) or 64,
        rope_theta=float(model.rope_theta),
        rotary_fraction=float(_get(model, "rotary_fraction", 1.0)),
        vocab_size=int(model.vocab_size),
        max_sequence_length=int(model.max_position_embeddings),
        tie_word_embeddings=bool(_get(model, "tie_word_embeddings", False)),
    )


def moe_fields(model: Any, parallel: Any) -> dict[str, Any]:
    """Megatron's MoE config fields from ``model.num_experts`` & co.; empty for a dense model.

    ``norm_topk_prob`` (HF) is Megatron's ``moe_router_pre_softmax=False``: a softmax over the
    top-k logits is the renormalised top-k probabilities. Experts are never split by TP
    (``expert_tensor_parallel_size=1``); EP spreads them over ranks.
    """
    experts = _get(model, "num_experts")
    if experts is None:
        return {}
    aux = float(_get(model, "moe_aux_loss_coeff", 0.0))
    shared = _get(model, "shared_expert_ffn_hidden_size")
    return {
        "num_moe_experts": int(experts),
        "moe_router_topk": int(model.moe_topk),
        "moe_ffn_hidden_size": int(model.moe_ffn_hidden_size),
        "moe_shared_expert_intermediate_size": None if shared is None else int(shared),
        "moe_shared_expert_gate": bool(_get(model, "shared_expert_gate", False)),
        "moe_router_pre_softmax": not bool(_get(model, "norm_topk_prob", True)),
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
        "moe_aux_loss_coeff": aux,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": int(_get(parallel, "ep", 1)),
        "expert_tensor_parallel_size": 1,
    }
