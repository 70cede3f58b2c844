"""Layer modules that both spec providers share or swap in.

- :class:`IsoRMSNorm`: RMSNorm through ``ops.norm`` (invariant in the correctness profile).
- :class:`CachedSelfAttention`: Megatron's ``SelfAttention`` whose forward takes an
  :class:`~megatron_iso.models.batch.IsoBatch` (packed rows, absolute positions, optional KV
  cache), so the trainer's forward, prefill and decode are one code path.
- :class:`PackedCoreAttention`: the ``core_attention`` submodule, calling ``ops.attention`` for
  packed training rows or for cache reads.
- :class:`IsoMLP`: Megatron's MLP with the invariant SwiGLU.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule

from megatron_iso.models.batch import IsoBatch
from megatron_iso.ops.activation import swiglu_packed
from megatron_iso.ops.attention import (
    attention_varlen,
    attention_with_kv_cache,
    attention_with_paged_kv_cache,
    paged_kv_reads,
)
from megatron_iso.ops.attention.segments import attention_query_runs
from megatron_iso.ops.norm import rms_norm
from megatron_iso.ops.rope import apply_rope, rope_cos_sin, rotary_dim_for
from megatron_iso.parallel.context import gather_sequence_rows
from megatron_iso.parallel.layer_config import iso_config


class IsoRMSNorm(torch.nn.Module):
    """RMSNorm with Megatron's norm constructor signature, computed by ``ops.norm``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        config = iso_config(config, type(self).__name__)
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.profile = config.iso_profile
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        # Replicated across TP ranks: with sequence parallelism its grad must be TP-reduced.
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = rms_norm(
            x.reshape(-1, shape[-1]), self.weight, self.eps, zero_centered=self.zero_centered, profile=self.profile
        )
        return out.reshape(shape)


class PackedCoreAttention(MegatronModule):
    """Causal GQA attention over packed rows or from a KV cache (``ops.attention``)."""

    def __init__(self, config, layer_number: int, softmax_scale: float | None = None, **_: object) -> None:
        config = iso_config(config, type(self).__name__)
        super().__init__(config=config)
        self.layer_index = layer_number - 1  # Megatron numbers layers from 1
        self.softmax_scale = softmax_scale
        self.profile = config.iso_profile
        self.kv_block = config.iso_kv_block

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: IsoBatch, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        common = {"softmax_scale": self.softmax_scale, "gate": gate, "kv_block": self.kv_block, "profile": self.profile}
        if batch.cp is not None:
            # Context parallelism: this rank's queries against every rank's keys, in CP 1's blocks and order.
            k_full, v_full = gather_sequence_rows(k, batch.cp), gather_sequence_rows(v, batch.cp)
            return attention_query_runs(q, k_full, v_full, batch.cp.runs, **common)
        if not batch.uses_cache:
            return attention_varlen(q, k, v, batch.cu_seqlens_q, **common)
        if paged_kv_reads(q, self.profile) and getattr(batch.kv_cache, "paged", False):
            # The Triton kernel reads the engine's paged pool in place: no staging copy, no write-back.
            return attention_with_paged_kv_cache(
                q,
                k,
                v,
                batch.kv_cache.paged_layer(self.layer_index),
                batch.cache_seqlens,
                batch.cu_seqlens_q,
                slots=batch.slots,
                plan=batch.kv_plan,
                **common,
            )
        k_cache, v_cache = batch.kv_cache.layer(self.layer_index)
        return attention_with_kv_cache(
            q,
            k,
            v,
            k_cache,
            v_cache,
            batch.cache_seqlens,
            batch.cu_seqlens_q,
            slots=batch.slots,
            plan=batch.kv_plan,
            **common,
        )


class CachedSelfAttention(SelfAttention):
    """Megatron SelfAttention driven by an :class:`IsoBatch` instead of masks and inference contexts.

    QKV projection, q/k norms and the output projection are Megatron's own code and submodules
    (so the spec provider decides which linears and norms run); RoPE and attention go through
    ``ops`` with absolute positions, identical for every case.
    """

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=None, **kwargs: object) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        config = iso_config(config, type(self).__name__)
        super().__init__(
            config, submodules, layer_number, attn_mask_type=attn_mask_type or AttnMaskType.causal, **kwargs
        )
        head_dim = self.hidden_size_per_attention_head
        self.rotary_dim = rotary_dim_for(head_dim, float(config.rotary_fraction))
        self.rope_theta = float(config.rope_theta)
        self.profile = config.iso_profile

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **_: object):
        batch = packed_seq_params
        if not isinstance(batch, IsoBatch):
            raise TypeError(
                "CachedSelfAttention needs packed_seq_params=IsoBatch (build it with megatron_iso.models.batch.pack); "
                f"got {type(batch).__name__}"
            )
        gated = bool(self.config.attention_output_gate)
        qkv = self.get_query_key_value_tensors(hidden_states, None, output_gate=gated)
        query, key, value = qkv[:3]
        gate = qkv[3].squeeze(1) if gated else None
        # [T, 1, heads, D] -> [T, heads, D]: the packed layout has batch dimension 1.
        query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        # The same positions in every layer: cos/sin once per forward (HF computes them once too).
        rope_key = ("rope_cos_sin", self.rotary_dim, self.rope_theta, self.profile)
        if rope_key not in batch.memo:
            batch.memo[rope_key] = rope_cos_sin(
                batch.positions,
                self.rotary_dim,
                self.rope_theta,
                profile=self.profile,
                max_position=batch.max_position,  # host bound from pack: no read-back to check the range
            )
        cos, sin = batch.memo[rope_key]
        query = apply_rope(query, cos, sin, profile=self.profile)
        key = apply_rope(key, cos, sin, profile=self.profile)
        if self.checkpoint_core_attention and self.training and torch.is_grad_enabled() and not batch.uses_cache:
            # rl.recompute_granularity=selective: the backward reruns this attention from q, k, v (Megatron's
            # checkpoint; the batch rides in the closure, it holds no tensor that needs a gradient).
            out = tensor_parallel.checkpoint(
                lambda q, k, v, g: self.core_attention(q, k, v, batch, gate=g), False, query, key, value, gate
            )
        else:
            out = self.core_attention(query, key, value, batch, gate=gate)
        out = out.reshape(out.shape[0], 1, -1)
        return self.linear_proj(out)


class IsoMLP(MLP):
    """Megatron's MLP whose gated activation is the invariant ``ops.activation.swiglu_packed``.

    Megatron's own GLU path calls ``F.silu``, whose vectorised and scalar lanes round differently
    on CPU, then multiplies in the input dtype (two roundings); here silu(gate) * up is one op
    with one rounding. Biases and fusions are off in megatron_iso's configs.
    """

    def __init__(self, config, *args: object, **kwargs: object) -> None:
        super().__init__(iso_config(config, type(self).__name__), *args, **kwargs)

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **_: object):
        if per_token_scale is not None:
            raise ValueError("IsoMLP: per_token_scale is not supported")
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            raise ValueError("IsoMLP: add_bias_linear must be False")
        return self.linear_fc2(swiglu_packed(intermediate, profile=self.config.iso_profile))
