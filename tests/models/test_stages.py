"""models.stages: a pipeline stage's share of the layers and the names of its parameters."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.models.stages import Stage, from_global_names, to_global_names

WHOLE = {
    "embedding.word_embeddings.weight": torch.zeros(1),
    **{f"decoder.layers.{i}.mlp.linear_fc1.weight": torch.full((1,), float(i)) for i in range(4)},
    "decoder.final_layernorm.weight": torch.zeros(1),
    "output_layer.weight": torch.zeros(1),
}


def test_stage_names_round_trip_and_split_the_model():
    first, last = Stage(0, 2, True, False), Stage(2, 2, False, True)
    a, b = from_global_names(WHOLE, first), from_global_names(WHOLE, last)
    assert set(a) == {
        "embedding.word_embeddings.weight",
        *(f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1)),
    }
    assert set(b) == {
        *(f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1)),
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    }
    assert float(b["decoder.layers.0.mlp.linear_fc1.weight"]) == 2.0  # the stage's first layer is global layer 2
    assert {**to_global_names(a, first), **to_global_names(b, last)} == WHOLE


def test_a_name_of_no_stage_is_refused():
    with pytest.raises(KeyError, match="belongs to no pipeline stage"):
        from_global_names({"rotary.inv_freq": torch.zeros(1)}, Stage(0, 1, True, True))
