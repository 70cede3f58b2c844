"""Gated DeltaNet token mixer (Qwen3-Next linear attention) for the hybrid stack.

Same structure and parameter names as Megatron-Core's ``GatedDeltaNet`` (``in_proj``, ``conv1d``,
``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``; Megatron's config fields ``linear_*``), but driven
by an :class:`~megatron_iso.models.batch.IsoBatch`: packed rows, and for rollout a
:class:`~megatron_iso.ops.gdn.GDNStateCache` with conv/recurrent state per sequence. Training,
prefill and decode run the same code; the ops (``ops.gdn``) make them the same bits (CPR).

TP shards heads: rank i holds key heads [i Hk/tp, (i+1) Hk/tp) and their value heads. ``in_proj``
(column-parallel) yields, per rank, ``[q | k | v | z | b | a]`` of its heads; conv, l2norm, gates,
the delta rule and the gated norm are per head; ``out_proj`` is row-parallel (the leaf tree in the
correctness profile), so every TP size computes the same expression.

Context parallelism (``IsoBatch.cp``): every part runs on the rank's own rows, the recurrence's state and the conv's
history passed rank to rank in sequence order (``models.gdn_context``), where the rule carries a state
(``ops.gdn.carries_state``: the correctness profile's CPU reference and GPU kernels). Elsewhere (the performance
profile: its native chunk loop is not aligned at sequence chunk boundaries) the conv and the rule run over the whole
pack on every CP rank, its rows gathered in packed order (:meth:`IsoGatedDeltaNet._mix_whole_pack`).
"""

from __future__ import annotations

import math

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megatron_iso.models.batch import IsoBatch
from megatron_iso.models.gdn_context import mix_chained
from megatron_iso.ops.common.dispatch import device_class_of
from megatron_iso.ops.gdn import GDNStateCache, carries_state, causal_conv1d, gated_delta_rule, gdn_gates, l2norm
from megatron_iso.ops.norm import gated_rms_norm
from megatron_iso.parallel.context import ContextShard, gather_sequence_rows
from megatron_iso.parallel.layer_config import iso_config


def gdn_layer_indices(config) -> list[int]:
    """0-based decoder layers that are GDN layers: all but every ``linear_attention_freq``-th
    (Megatron's int form of the pattern; Qwen3-Next's ``full_attention_interval``)."""
    freq = getattr(config, "linear_attention_freq", None)
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net" or freq is None:
        return []
    if isinstance(freq, list):
        return [i for i, la in enumerate(freq) if la]
    return [i for i in range(config.num_layers) if (i + 1) % int(freq)]


class GatedRMSNorm(torch.nn.Module):
    """``rms_norm(x) * silu(gate)`` per value head (``ops.norm.gated_rms_norm``).

    Plain scale ``w`` (init 1), not zero-centred: HF ``Qwen3NextRMSNormGated`` multiplies by its
    weight, unlike the model's other norms.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.profile = iso_config(config, type(self).__name__).iso_profile
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, profile=self.profile)


class IsoGatedDeltaNet(MegatronModule):
    """GDN layer: in_proj -> causal conv1d + SiLU -> l2norm(q, k) -> gates -> gated delta rule ->
    gated RMSNorm with z -> out_proj. Returns Megatron's ``(output, bias)``."""

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int, **_: object) -> None:
        config = iso_config(config, type(self).__name__)
        super().__init__(config=config)
        self.layer_index = layer_number - 1  # Megatron numbers layers from 1
        self.profile = config.iso_profile
        self.chunk = config.iso_gdn_chunk
        self.form = config.iso_gdn_form
        self.dot_precision = config.iso_gdn_dot_precision
        self.backward_states = config.iso_gdn_backward_states
        tp = config.tensor_model_parallel_size
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if hk % tp or hv % hk:
            raise ValueError(
                f"linear_num_key_heads={hk} must be divisible by parallel.tp={tp}, and "
                f"linear_num_value_heads={hv} a multiple of linear_num_key_heads"
            )
        self.hk, self.hv = hk // tp, hv // tp  # this rank's heads
        self.conv_dim = self.hk * self.dk * 2 + self.hv * self.dv
        self.in_proj = build_module(
            submodules.in_proj,
            config.hidden_size,
            (hk * self.dk * 2 + hv * self.dv * 2 + hv * 2),
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
        )
        kw = int(config.linear_conv_kernel_dim)
        self.conv1d = torch.nn.Conv1d(
            self.conv_dim, self.conv_dim, kw, groups=self.conv_dim, bias=False, dtype=config.params_dtype
        )  # a parameter holder with Megatron's name and shape [conv_dim, 1, K]; ops.gdn runs the conv
        self.dt_bias = torch.nn.Parameter(torch.ones(self.hv, dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.hv, dtype=config.params_dtype).uniform_(1, 16).log())
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            p.tensor_model_parallel = True
            p.partition_dim = 0
        self.out_norm = build_module(
            submodules.out_norm, config=config, hidden_size=self.dv, eps=config.layernorm_epsilon
        )
        self.out_proj = build_module(
            submodules.out_proj,
            hv * self.dv,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The checkpoint layout of Megatron-Core's ``GatedDeltaNet``: the per-head tensors (conv1d, A_log, dt_bias)
        sharded over TP, and in_proj / conv1d split into their q, k, v (, z, b, a) parts, each sharded over TP on its
        own, so a checkpoint holds the TP 1 tensors whatever TP wrote it (a rank's in_proj rows are
        ``[q | k | v | z | b | a]`` of its own heads, not a slice of TP 1's)."""
        from megatron.core import parallel_state
        from megatron.core.ssm.gated_delta_net import _split_tensor_factory
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
            sharded_state_dict_default,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        groups = {"tp_group": parallel_state.get_tensor_model_parallel_group(), "dp_cp_group": metadata["dp_cp_group"]}
        own: dict = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets, **groups)
        for name, module in self.named_children():
            if name == "conv1d":
                conv = module.state_dict(prefix="", keep_vars=True)
                out.update(make_sharded_tensors_for_checkpoint(conv, f"{prefix}conv1d.", {"weight": 0}, sharded_offsets,
                                                               **groups))  # fmt: skip
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=groups["tp_group"]))  # fmt: skip
        kd, vd = self.hk * self.dk, self.hv * self.dv
        parts = ["query", "key", "value", "z", "beta", "alpha"]
        key = f"{prefix}in_proj.weight"
        out[key] = _split_tensor_factory(out[key], [kd, kd, vd, vd, self.hv, self.hv], parts, 0)
        key = f"{prefix}conv1d.weight"
        out[key] = _split_tensor_factory(out[key], [kd, kd, vd], parts[:3], 0)
        return out

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **_: object):
        batch = packed_seq_params
        if not isinstance(batch, IsoBatch):
            raise TypeError(
                "IsoGatedDeltaNet needs packed_seq_params=IsoBatch (megatron_iso.models.batch.pack); "
                f"got {type(batch).__name__}"
            )
        x, _ = self.in_proj(hidden_states)
        x = x.squeeze(1)  # packed rows: batch dimension 1
        vd = self.hv * self.dv
        qkv, z, b, a = torch.split(x, [self.conv_dim, vd, self.hv, self.hv], dim=-1)
        if batch.cp is None:
            o = self._mix(qkv, b, a, batch)
        elif carries_state(device_class_of(qkv), self.profile, self.form, self.dot_precision):
            o = mix_chained(self, qkv, b, a, batch.cp)
        else:
            o = self._mix_whole_pack(qkv, b, a, batch.cp)
        o = self.out_norm(o.to(hidden_states.dtype), z.reshape(-1, self.hv, self.dv))
        return self.out_proj(o.reshape(-1, 1, vd))

    def _mix_whole_pack(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        """Context parallelism where the rule cannot carry a state (``ops.gdn.carries_state``): the conv and the delta
        rule need each sequence's rows in order from its first token, so every CP rank gathers the conv and gate inputs of the whole (padded) pack in packed order, runs them as
        CP 1 does on the same rows (the same bits), and keeps its own rows' outputs. The gather's backward sums each
        row's gradient over the ranks (``parallel.context.gather_sequence_rows``): deterministic, not bitwise CP 1's.
        Costs and the state-passing alternative: docs/CONTEXT_PARALLEL.md."""
        width = [qkv.shape[-1], b.shape[-1], a.shape[-1]]
        whole = gather_sequence_rows(torch.cat([qkv, b, a], dim=-1), shard)
        qkv, b, a = torch.split(whole, width, dim=-1)
        whole_batch = IsoBatch(qkv_format="thd", cu_seqlens_q=shard.packed_cu, cu_seqlens_kv=shard.packed_cu)
        return self._mix(qkv, b, a, whole_batch)[shard.index]

    def _mix(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, batch: IsoBatch) -> torch.Tensor:
        """conv1d + SiLU, l2norm, gates and the gated delta rule over ``batch``'s sequences: fp32 ``[T, Hv, Dv]``."""
        state = batch.gdn_cache.layer(self.layer_index) if batch.gdn_cache is not None else None
        slots = batch.gdn_slots if batch.gdn_slots is not None else batch.slots
        common = {"slots": slots, "starts": batch.cache_seqlens if state is not None else None}
        q, k, v, g, beta = self.features(
            qkv, b, a, batch.cu_seqlens_q, self.parameters_of_rule(), conv_state=None if state is None else state.conv,
            **common,
        )  # fmt: skip
        return gated_delta_rule(q, k, v, g, beta, batch.cu_seqlens_q, state=state, **self.rule_options(), **common)

    def parameters_of_rule(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv weight ``[Cd, 1, K]``, ``A_log`` and ``dt_bias``: what :meth:`features` reads."""
        return self.conv1d.weight, self.A_log, self.dt_bias

    def rule_options(self) -> dict:
        """The delta rule's keyword arguments fixed by the layer and its profile."""
        return {"scale": 1.0 / math.sqrt(self.dk), "chunk": self.chunk, "profile": self.profile, "form": self.form,
                "dot_precision": self.dot_precision, "backward_states": self.backward_states}  # fmt: skip

    def features(
        self,
        qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        cu_seqlens: torch.Tensor,
        params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        **conv_kw,
    ) -> tuple[torch.Tensor, ...]:
        """The rule's inputs ``(q, k, v, g, beta)`` of rows ``qkv, b, a`` (sequences ``cu_seqlens``): conv1d + SiLU,
        l2norm of q and k, the gates. ``params``: :meth:`parameters_of_rule` (or detached copies of them)."""
        t = qkv.shape[0]
        weight, A_log, dt_bias = params
        kd, vd = self.hk * self.dk, self.hv * self.dv
        qkv = causal_conv1d(qkv, weight[:, 0], cu_seqlens, profile=self.profile, **conv_kw)
        qk, v = torch.split(qkv, [2 * kd, vd], dim=-1)
        # q's and k's heads side by side: one row-wise l2norm call for both (the rule reads the halves where they lie)
        q, k = l2norm(qk.reshape(t, 2 * self.hk, self.dk), profile=self.profile).split(self.hk, dim=1)
        g, beta = gdn_gates(a, b, A_log, dt_bias, profile=self.profile)
        return q, k, v.reshape(t, self.hv, self.dv), g, beta


def allocate_gdn_cache(config, slots: int, device: torch.device | str = "cpu") -> GDNStateCache:
    """Empty GDN state for ``slots`` sequences, for this TP rank's heads, every GDN layer of ``config``."""
    tp = config.tensor_model_parallel_size
    hk, hv = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    config = iso_config(config, "allocate_gdn_cache")
    form = config.iso_gdn_form
    u_dtype = torch.float32
    if form == "chunk":  # the chunk form exists only on the GPU kernels, which decide how they store u
        from megatron_iso.ops.gdn.triton.tuning import chunk_u_dtype

        u_dtype = chunk_u_dtype(config.iso_gdn_dot_precision)
    return GDNStateCache.allocate(
        gdn_layer_indices(config),
        slots,
        conv_dim=hk * dk * 2 + hv * dv,
        conv_kernel=int(config.linear_conv_kernel_dim),
        key_heads=hk,
        value_heads=hv,
        key_dim=dk,
        value_dim=dv,
        chunk=config.iso_gdn_chunk,
        dtype=config.params_dtype,
        device=device,
        form=form,
        v_dtype=config.params_dtype,  # v leaves the conv in the model's dtype
        u_dtype=u_dtype,
    )
