"""Two spec providers over one module tree.

``iso`` (profile ``correctness``) and ``native`` (profile ``performance``) build the same
Megatron structure — TransformerLayer -> CachedSelfAttention(linear_qkv, core_attention,
linear_proj, q/k norms) + MLP(linear_fc1, linear_fc2) — and differ only in which classes fill the
swappable submodules: leaf-tree linears and invariant norms vs Megatron's stock local layers.
The profile also tells ``ops`` which kernels the shared modules call.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_iso.models.gdn import GatedRMSNorm, IsoGatedDeltaNet
from megatron_iso.models.modules import CachedSelfAttention, IsoMLP, IsoRMSNorm, PackedCoreAttention
from megatron_iso.models.moe import (
    IsoMoELayer,
    IsoMoETransformerLayer,
    IsoSequentialExperts,
    IsoSharedExpertMLP,
    IsoTopKRouter,
    ReplayTopKRouter,
)
from megatron_iso.models.moe_serving import NativeMoELayer
from megatron_iso.parallel.layers import LeafTreeColumnParallelLinear, LeafTreeRowParallelLinear
from megatron_iso.registry import PROFILES, Profile


@dataclass(frozen=True)
class LayerKit:
    """The swappable classes a spec provider puts into the shared module tree."""

    column_linear: type
    row_linear: type
    norm: type
    mlp: type


ISO_KIT = LayerKit(
    column_linear=LeafTreeColumnParallelLinear, row_linear=LeafTreeRowParallelLinear, norm=IsoRMSNorm, mlp=IsoMLP
)
NATIVE_KIT = LayerKit(column_linear=ColumnParallelLinear, row_linear=RowParallelLinear, norm=WrappedTorchNorm, mlp=MLP)


def layer_kit(profile: str) -> LayerKit:
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not allowed; allowed values: {list(PROFILES)}")
    return ISO_KIT if profile == Profile.CORRECTNESS else NATIVE_KIT


def attention_spec(kit: LayerKit) -> ModuleSpec:
    return ModuleSpec(
        module=CachedSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=kit.column_linear,
            core_attention=PackedCoreAttention,
            linear_proj=kit.row_linear,
            q_layernorm=kit.norm,
            k_layernorm=kit.norm,
        ),
    )


def dense_mlp_spec(kit: LayerKit) -> ModuleSpec:
    return ModuleSpec(module=kit.mlp, submodules=MLPSubmodules(linear_fc1=kit.column_linear, linear_fc2=kit.row_linear))


def moe_mlp_spec(profile: str) -> ModuleSpec:
    """Megatron's MoELayer tree (router, experts.local_experts.{i}, shared_experts) for ``profile``.

    correctness: invariant router, experts, shared expert and dispatcher (``models.moe``);
    performance: Megatron's stock TopKRouter (``ReplayTopKRouter``: with routing replay's hook, ``models.routing``),
    SequentialMLP, SharedExpertMLP and all-to-all dispatcher, in Megatron's MoELayer (``NativeMoELayer``: a serving
    step's forward dispatches by static shapes from stock parts, ``models.moe_serving``).
    """
    kit = layer_kit(profile)
    iso = profile == Profile.CORRECTNESS
    expert_mlp = MLPSubmodules(linear_fc1=kit.column_linear, linear_fc2=kit.row_linear)
    return ModuleSpec(
        module=IsoMoELayer if iso else NativeMoELayer,
        submodules=MoESubmodules(
            router=IsoTopKRouter if iso else ReplayTopKRouter,
            experts=ModuleSpec(module=IsoSequentialExperts if iso else SequentialMLP, submodules=expert_mlp),
            shared_experts=ModuleSpec(module=IsoSharedExpertMLP if iso else SharedExpertMLP, submodules=expert_mlp),
        ),
    )


def gdn_spec(kit: LayerKit) -> ModuleSpec:
    """Gated DeltaNet token mixer (Megatron's GatedDeltaNetSubmodules); its ops follow the profile."""
    return ModuleSpec(
        module=IsoGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=kit.column_linear, out_norm=GatedRMSNorm, out_proj=kit.row_linear),
    )


def _layer_spec(kit: LayerKit, mlp: ModuleSpec, mixer: ModuleSpec | None = None) -> ModuleSpec:
    # An MoE layer re-enters its model call's static-shape path when activation recompute reruns it (models.moe).
    moe = mlp.module in (IsoMoELayer, NativeMoELayer)
    return ModuleSpec(
        module=IsoMoETransformerLayer if moe else TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=kit.norm,
            self_attention=mixer or attention_spec(kit),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=kit.norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def dense_layer_spec(profile: str) -> ModuleSpec:
    """A Qwen3-style dense decoder layer for ``profile``."""
    kit = layer_kit(profile)
    return _layer_spec(kit, dense_mlp_spec(kit))


def moe_layer_spec(profile: str) -> ModuleSpec:
    """A Qwen3-MoE-style decoder layer (attention + MoE MLP) for ``profile``."""
    return _layer_spec(layer_kit(profile), moe_mlp_spec(profile))


def dense_block_spec(profile: str, num_layers: int) -> TransformerBlockSubmodules:
    """All decoder layers plus the final norm (from the same kit, so it is invariant too)."""
    return TransformerBlockSubmodules(
        layer_specs=[dense_layer_spec(profile)] * num_layers, layer_norm=layer_kit(profile).norm
    )


def moe_block_spec(profile: str, num_layers: int) -> TransformerBlockSubmodules:
    """Every decoder layer MoE (Qwen3-MoE: ``decoder_sparse_step=1``, no ``mlp_only_layers``)."""
    return TransformerBlockSubmodules(
        layer_specs=[moe_layer_spec(profile)] * num_layers, layer_norm=layer_kit(profile).norm
    )


def hybrid_block_spec(
    profile: str, num_layers: int, gdn_layers: Collection[int], *, moe: bool = False
) -> TransformerBlockSubmodules:
    """Qwen3-Next-style hybrid: GDN token mixers at ``gdn_layers`` (0-based), gated full attention
    elsewhere; dense or MoE MLPs everywhere (Qwen3-Next: ``decoder_sparse_step=1``)."""
    kit = layer_kit(profile)
    # Qwen3-Next's norms are zero-centred, which torch's RMSNorm cannot express; IsoRMSNorm under the
    # performance profile runs HF's formula (ops.norm.native), so the native stack stays stock.
    kit = replace(kit, norm=IsoRMSNorm)
    bad = sorted(i for i in gdn_layers if not 0 <= i < num_layers)
    if bad:
        raise ValueError(f"gdn_layers {bad} are outside 0..{num_layers - 1}")
    mlp = moe_mlp_spec(profile) if moe else dense_mlp_spec(kit)
    gdn, attn = _layer_spec(kit, mlp, gdn_spec(kit)), _layer_spec(kit, mlp)
    return TransformerBlockSubmodules(
        layer_specs=[gdn if i in gdn_layers else attn for i in range(num_layers)], layer_norm=kit.norm
    )
