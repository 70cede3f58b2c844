"""IsoTransformerConfig: the layers' iso knobs are required typed fields, checked on construction, and an iso layer
refuses a plain Megatron config instead of taking defaults."""

from __future__ import annotations

import dataclasses

import pytest
from megatron.core.transformer import TransformerConfig

from megatron_iso.models.gdn import GatedRMSNorm
from megatron_iso.models.modules import IsoRMSNorm
from megatron_iso.models.transformer_config import IsoTransformerConfig, transformer_config
from megatron_iso.settings.compose import load_config

SHAPE = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1}


def test_a_config_without_the_iso_fields_names_them():
    with pytest.raises(TypeError, match="iso_profile.*iso_leaves.*iso_kv_block.*rope_theta.*vocab_size"):
        IsoTransformerConfig(**SHAPE)


def test_the_built_config_carries_the_profile_and_gdn_knobs():
    dense = transformer_config(load_config(["model=tiny_dense", "profile=performance"]))
    assert (dense.iso_profile, dense.iso_gdn_chunk, dense.hf_gdn_layout) == ("performance", None, None)
    hybrid = transformer_config(load_config(["model=tiny_hybrid"]))
    assert (hybrid.iso_gdn_chunk, hybrid.iso_gdn_form, hybrid.iso_gdn_backward_states) == (64, "scan", "keep")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"iso_profile": "fast"}, "iso_profile='fast'"),
        ({"iso_gdn_chunk": None}, "needs iso_gdn_chunk"),
        ({"iso_gdn_form": "auto"}, "iso_gdn_form='auto'"),
        ({"iso_gdn_backward_states": "drop"}, "iso_gdn_backward_states='drop'"),
    ],
)
def test_bad_or_missing_knobs_fail_on_construction(change: dict, message: str):
    hybrid = transformer_config(load_config(["model=tiny_hybrid"]))
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(hybrid, **change)


@pytest.mark.parametrize("layer", [IsoRMSNorm, GatedRMSNorm])
def test_an_iso_layer_refuses_a_plain_megatron_config(layer):
    with pytest.raises(TypeError, match=f"{layer.__name__} needs an IsoTransformerConfig"):
        layer(TransformerConfig(**SHAPE), 8)
