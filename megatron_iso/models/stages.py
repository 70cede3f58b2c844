"""Pipeline stages: which decoder layers a pipeline rank builds, and the names of its parameters.

Megatron's ``TransformerBlock`` builds every layer spec it is given, so a stage's block spec is the
whole model's sliced to the stage's layers (Megatron's own ``get_transformer_layer_offset`` and
``get_num_layers_to_build``: the same even split its GPT specs use). A stage's modules number their
layers globally (``layer_number``), but its parameters are named by local index
(``decoder.layers.0`` is the stage's first layer); :func:`to_global_names` / :func:`from_global_names`
convert between a stage's names and the whole model's, which :mod:`megatron_iso.models.weights` reads
and writes (HF names <-> whole-model Megatron names). The first stage holds the embedding, the last the
final norm and the LM head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_FIRST_STAGE = ("embedding.",)
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")


@dataclass(frozen=True)
class Stage:
    """One pipeline rank's share of the model: layers ``[offset, offset + layers)``, and the ends it holds."""

    offset: int
    layers: int
    first: bool
    last: bool
    group: Any = field(default=None, compare=False, repr=False)  # the pipeline's process group (None: one stage)


def current_stage(config: Any) -> Stage:
    """This rank's stage under Megatron's parallel_state (the whole model without pipeline parallelism)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.pipeline_model_parallel_size == 1:
        return Stage(0, config.num_layers, True, True)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return Stage(
        offset=get_transformer_layer_offset(config, vp_stage=None, pp_rank=rank),
        layers=get_num_layers_to_build(config, vp_stage=None, pp_rank=rank),
        first=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        last=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )


def stage_block_spec(spec: Any, stage: Stage) -> Any:
    """The whole model's block spec (``TransformerBlockSubmodules``) cut to ``stage``'s layers."""
    return replace(spec, layer_specs=list(spec.layer_specs[stage.offset : stage.offset + stage.layers]))


def _held(name: str, stage: Stage) -> bool:
    match = _LAYER.match(name)
    if match:
        return stage.offset <= int(match.group(1)) < stage.offset + stage.layers
    if name.startswith(_FIRST_STAGE):
        return stage.first
    if name.startswith(_LAST_STAGE):
        return stage.last
    raise KeyError(f"parameter '{name}' belongs to no pipeline stage")


def _shift(name: str, by: int) -> str:
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"decoder.layers.{int(match.group(1)) + by}.{name[match.end() :]}"


def from_global_names(params: Mapping[str, torch.Tensor], stage: Stage) -> dict[str, torch.Tensor]:
    """The tensors of whole-model Megatron names that ``stage`` holds, under the stage's own names."""
    return {_shift(n, -stage.offset): t for n, t in params.items() if _held(n, stage)}


def to_global_names(params: Mapping[str, torch.Tensor], stage: Stage) -> dict[str, torch.Tensor]:
    """A stage's parameters under whole-model Megatron names (layers renumbered from ``stage.offset``)."""
    return {_shift(n, stage.offset): t for n, t in params.items()}
