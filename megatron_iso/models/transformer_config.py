"""From the Hydra config (model, profile, parallel) to Megatron's TransformerConfig.

:class:`IsoTransformerConfig` (declared in :mod:`megatron_iso.parallel.layer_config`, the lowest layer that reads
it) is Megatron's config plus the fields megatron_iso's layers read; :func:`transformer_config` fills every one.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from megatron_iso.parallel.layer_config import IsoTransformerConfig
from megatron_iso.registry import PROFILES
from megatron_iso.settings import (
    HF_GDN_LAYOUTS,
    ModelSettings,
    ParallelSettings,
    ProfileSettings,
    Settings,
    check_backward_states,
    resolve,
    resolve_gdn,
    resolve_profile,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
__all__ = [
    "DTYPES",
    "HF_GDN_LAYOUTS",
    "PROFILES",
    "IsoTransformerConfig",
    "gdn_fields",
    "is_hybrid",
    "moe_fields",
    "sharded_sizes",
]


def is_hybrid(model: Any) -> bool:
    """Whether ``model`` interleaves Gated DeltaNet layers with full attention (it sets ``full_attention_interval``)."""
    value = (
        model.get("full_attention_interval")
        if hasattr(model, "get")
        else getattr(model, "full_attention_interval", None)
    )
    return value is not None


def gdn_fields(model: Any, profile: Any, rl: Any, device_class: str) -> dict[str, Any]:
    """Megatron's Gated DeltaNet fields for a hybrid model from raw groups (``rl``: for ``rl.gdn_backward_states``,
    default "keep"; ``device_class`` resolves ``profile.gdn_form=auto``); empty otherwise. See :func:`_gdn_fields`."""
    gdn_rl = rl.get("gdn_backward_states") if rl is not None else None
    return _gdn_fields(
        resolve_gdn(model) if is_hybrid(model) else None,
        resolve_profile(profile, device_class),
        check_backward_states("keep" if gdn_rl is None else gdn_rl),
    )


def _gdn_fields(model: ModelSettings | Any, profile: ProfileSettings, backward_states: str) -> dict[str, Any]:
    """Megatron's Gated DeltaNet fields (``experimental_attention_variant``, ``linear_*``) for a hybrid
    model (one with ``full_attention_interval``); empty otherwise. Every ``full_attention_interval``-th
    layer is full attention (Megatron's ``linear_attention_freq``, HF's ``layer_types``)."""
    gdn = model.gdn if isinstance(model, ModelSettings) else model
    if gdn is None:
        return {}
    return {
        "experimental_attention_variant": "gated_delta_net",
        "hf_gdn_layout": gdn.hf_layout,
        # Megatron's int form (every k-th layer full attention) or its list form (1 = linear attention, per layer).
        "linear_attention_freq": gdn.full_attention_interval
        if isinstance(gdn.full_attention_interval, int)
        else [int(t == "linear_attention") for t in gdn.full_attention_interval],
        "linear_conv_kernel_dim": gdn.conv_kernel_dim,
        "linear_key_head_dim": gdn.key_head_dim,
        "linear_value_head_dim": gdn.value_head_dim,
        "linear_num_key_heads": gdn.num_key_heads,
        "linear_num_value_heads": gdn.num_value_heads,
        "iso_gdn_chunk": profile.gdn_chunk,
        "iso_gdn_form": profile.gdn_form,
        "iso_gdn_dot_precision": profile.gdn_dot_precision,
        "iso_gdn_backward_states": backward_states,
    }


def transformer_config(cfg: Any) -> IsoTransformerConfig:
    """Build the Megatron config for ``cfg.model`` under ``cfg.profile`` and ``cfg.parallel`` (a raw config, read
    through :func:`megatron_iso.settings.resolve`, or its :class:`~megatron_iso.settings.Settings`)."""
    s: Settings = resolve(cfg)
    dtype = DTYPES[s.model.params_dtype]
    with warnings.catch_warnings():
        # Megatron warns that Transformer Engine's fused attention needs no core_attn recompute; ours is not TE's.
        warnings.filterwarnings("ignore", message="If you are using transformer_engine")
        return _iso_config(s, dtype)


def _iso_config(s: Settings, dtype: torch.dtype) -> IsoTransformerConfig:
    model, profile, parallel = s.model, s.profile, s.parallel
    return IsoTransformerConfig(
        **_gdn_fields(model, profile, s.gdn_backward_states),
        **moe_fields(model, parallel),
        **recompute_fields(s.rl),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        layernorm_zero_centered_gamma=model.zero_centered_norm,
        qk_layernorm=model.qk_layernorm,
        attention_output_gate=model.attention_output_gate,
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
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sp and parallel.tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        init_method_std=model.init_std,
        iso_profile=profile.name.value,
        iso_leaves=profile.leaves,
        iso_expert_leaves=profile.expert_leaves,
        iso_kv_block=profile.attention_kv_block,
        rope_theta=model.rope_theta,
        rotary_fraction=model.rotary_fraction,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        tie_word_embeddings=model.tie_word_embeddings,
    )


def sharded_sizes(config: IsoTransformerConfig) -> dict[str, Any]:
    """The sizes Megatron shards by TP and EP (``settings.SHARDED_BY``), under the model group's names, read back from
    a built config: what ``settings.check_shardable`` reads, for a layout other than the config's own (the weight
    loader shards one config's weights at any TP / EP)."""
    return {
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
        "shared_expert_ffn_hidden_size": config.moe_shared_expert_intermediate_size,
        "vocab_size": config.vocab_size,
        "num_experts": config.num_moe_experts,
    }


def recompute_fields(rl: Any) -> dict[str, Any]:
    """Megatron's activation-recompute fields from ``rl.recompute_*`` (checked by the settings); empty without
    an ``rl`` group or with recompute off. Not a contract field: recompute reruns the same forward ops on the
    same inputs in the backward, so logprobs and gradients keep their bits."""
    if rl is None or rl.recompute_granularity is None:
        return {}
    out: dict[str, Any] = {"recompute_granularity": rl.recompute_granularity}
    if rl.recompute_granularity == "full":
        out |= {"recompute_method": rl.recompute_method, "recompute_num_layers": rl.recompute_num_layers}
    else:
        out["recompute_modules"] = list(rl.recompute_modules or ["core_attn"])
    return out


def moe_fields(model: ModelSettings, parallel: ParallelSettings) -> dict[str, Any]:
    """Megatron's MoE config fields from ``model.num_experts`` & co.; empty for a dense model.

    ``norm_topk_prob`` (HF) is Megatron's ``moe_router_pre_softmax=False``: a softmax over the
    top-k logits is the renormalised top-k probabilities. Experts are never split by TP
    (``expert_tensor_parallel_size=1``); EP spreads them over ranks.
    """
    moe = model.moe
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if moe.aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": parallel.ep,
        "expert_tensor_parallel_size": 1,
    }
