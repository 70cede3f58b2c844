"""The one typed config every megatron_iso layer reads: Megatron's ``TransformerConfig`` plus the iso knobs.

The fields are declared here, typed, and read as plain attributes (``config.iso_leaves``); those a model builder
must decide are keyword-only without a default, so a config that leaves one out fails on construction naming it
instead of a layer silently taking a default. :func:`megatron_iso.models.transformer_config.transformer_config` builds one from
the settings. It lives in ``parallel/``, the lowest layer whose modules (the invariant linears and embedding) read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_iso.ops.gdn import check_backward_states
from megatron_iso.ops.gdn.state_cache import OUTPUT_FORMS
from megatron_iso.registry import PROFILES

# GDN knobs a hybrid model (experimental_attention_variant="gated_delta_net") must set; a dense or MoE model leaves
# them None. iso_gdn_dot_precision is not here: None is one of its values (the kernels' default precision).
_GDN_REQUIRED = ("iso_gdn_chunk", "iso_gdn_form", "iso_gdn_backward_states", "hf_gdn_layout")


@dataclass
class IsoTransformerConfig(TransformerConfig):
    # Required: the profile and the model decide them (keyword-only, so they may follow Megatron's defaulted fields).
    iso_profile: str = field(kw_only=True)  # correctness = invariant ops; performance = stock ops
    iso_leaves: int = field(kw_only=True)  # leaves of row-parallel GEMMs and of the vocab log-sum-exp
    iso_expert_leaves: int = field(kw_only=True)  # routed experts' down projection: expert TP is 1, K never split
    iso_kv_block: int = field(kw_only=True)  # attention reduces keys in blocks of this many positions
    rope_theta: float = field(kw_only=True)
    rotary_fraction: float = field(kw_only=True)  # share of head_dim rotated (Qwen3-Next: 0.25)
    vocab_size: int = field(kw_only=True)
    max_sequence_length: int = field(kw_only=True)
    tie_word_embeddings: bool = field(kw_only=True)
    # A design constant, not a setting: column-parallel GEMMs never split K across ranks, so batch invariance is
    # all they need and 1 leaf is the cheapest on GPU.
    iso_column_leaves: int = 1
    # Hybrid models only (checked in __post_init__):
    iso_gdn_chunk: int | None = None  # CPR chunk of the Gated DeltaNet layers (profile.gdn_chunk)
    iso_gdn_form: str | None = None  # GDN output form on the GPU (profile.gdn_form resolved: scan or chunk)
    iso_gdn_dot_precision: str | None = None  # GDN kernels' dot precision on the GPU (profile.gdn_dot_precision)
    iso_gdn_backward_states: str | None = None  # what a GPU GDN forward keeps for the backward (rl.gdn_backward_states)
    # How HF checkpoints store GDN's input projections (model.hf_gdn_layout; naming only, same computation):
    # "qkvz" = Qwen3-Next's in_proj_qkvz/in_proj_ba grouped per key head, "split" = Qwen3.5's flat in_proj_qkv/z/b/a.
    hf_gdn_layout: str | None = None

    def __post_init__(self) -> None:
        cp = self.context_parallel_size
        if self.experimental_attention_variant == "gated_delta_net":
            # Megatron refuses CP for its own GatedDeltaNet; ours (models.gdn.IsoGatedDeltaNet) runs it.
            self.context_parallel_size = 1
        try:
            super().__post_init__()
        finally:
            self.context_parallel_size = cp
        if self.iso_profile not in PROFILES:
            raise ValueError(f"config.iso_profile={self.iso_profile!r}; expected one of {PROFILES}")
        if self.experimental_attention_variant == "gated_delta_net":
            missing = [name for name in _GDN_REQUIRED if getattr(self, name) is None]
            if missing:
                raise ValueError(f"IsoTransformerConfig: a Gated DeltaNet model needs {', '.join(missing)} set")
            if self.iso_gdn_form not in OUTPUT_FORMS:
                raise ValueError(f"config.iso_gdn_form={self.iso_gdn_form!r}; expected one of {OUTPUT_FORMS}")
            check_backward_states(self.iso_gdn_backward_states, "config.iso_gdn_backward_states")


def iso_config(config: object, layer: str) -> IsoTransformerConfig:
    """``config`` if it is an :class:`IsoTransformerConfig`, else a TypeError naming ``layer`` and what to pass:
    a plain Megatron config lacks the knobs the layer reads."""
    if not isinstance(config, IsoTransformerConfig):
        raise TypeError(
            f"{layer} needs an IsoTransformerConfig (megatron_iso.models.transformer_config.transformer_config builds one from "
            f"the settings), got {type(config).__name__}"
        )
    return config
