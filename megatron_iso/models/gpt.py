"""The decoder-only model: Megatron-Core's GPTModel built from megatron_iso's block spec."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

import torch
from megatron.core.models.gpt import GPTModel

from megatron_iso.models.batch import IsoBatch
from megatron_iso.models.gdn import gdn_layer_indices
from megatron_iso.models.moe import static_shapes as moe_static_shapes
from megatron_iso.models.specs import dense_block_spec, hybrid_block_spec, moe_block_spec
from megatron_iso.models.stages import current_stage, stage_block_spec
from megatron_iso.models.transformer_config import IsoTransformerConfig
from megatron_iso.models.weights import load_hf_state_dict
from megatron_iso.parallel.embedding import IsoVocabParallelEmbedding
from megatron_iso.parallel.layers import LeafTreeColumnParallelLinear
from megatron_iso.registry import Profile


class _UnknownMlpWarningFilter(logging.Filter):
    """Drops Megatron's "Unknown MLP type" warning. TransformerLayer logs it for every layer whose MLP spec is not one
    of Megatron's own classes, naming only ``ModuleSpec``; the MLPs of :func:`block_spec` are ours and take the
    default kwargs by design, so on our builds it says nothing but repeats once per layer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


@contextlib.contextmanager
def _our_mlp_specs() -> Iterator[None]:
    """While our block spec's layers are built (only then: a user's own spec still gets the warning)."""
    log = logging.getLogger("megatron.core.transformer.transformer_layer")
    quiet = _UnknownMlpWarningFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


class IsoGPTModel(GPTModel):
    """GPTModel whose vocab-parallel ends are invariant in the correctness profile.

    GPTModel hard-codes stock classes for the word embedding and the output layer; with the
    correctness profile both are replaced by their invariant subclasses (same parameters, same
    names), so checkpoints are interchangeable between profiles. RoPE is applied inside
    :class:`~megatron_iso.models.modules.CachedSelfAttention` from absolute positions, hence
    ``position_embedding_type='none'`` here.
    """

    def __init__(self, config: IsoTransformerConfig, *, pre_process: bool = True, post_process: bool = True) -> None:
        with _our_mlp_specs():
            super().__init__(
                config=config,
                transformer_layer_spec=block_spec(config),
                vocab_size=config.vocab_size,
                max_sequence_length=config.max_sequence_length,
                pre_process=pre_process,
                post_process=post_process,
                parallel_output=True,
                share_embeddings_and_output_weights=config.tie_word_embeddings,
                position_embedding_type="none",
            )
        if config.iso_profile != Profile.CORRECTNESS:
            return
        if pre_process:
            stock = self.embedding.word_embeddings
            self.embedding.word_embeddings = IsoVocabParallelEmbedding(
                num_embeddings=config.vocab_size,
                embedding_dim=config.hidden_size,
                init_method=config.init_method,
                config=config,
                reduce_scatter_embeddings=stock.reduce_scatter_embeddings,
            )
        if post_process:
            self.output_layer = LeafTreeColumnParallelLinear(
                config.hidden_size,
                self.vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=False,
                skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights,
            )
            if self.pre_process and self.share_embeddings_and_output_weights:
                self.setup_embeddings_and_output_layer()

    def forward(self, *args, packed_seq_params=None, **kwargs):
        """GPTModel's forward; a batch with ``static_shapes`` runs its MoE layers' static-shape path (a training
        forward keeps its expert counts on the batch for the layers activation recompute reruns: models.moe)."""
        static = isinstance(packed_seq_params, IsoBatch) and packed_seq_params.static_shapes
        training = static and self.training and torch.is_grad_enabled()
        with moe_static_shapes(static, recompute_batch=packed_seq_params if training else None):
            return super().forward(*args, packed_seq_params=packed_seq_params, **kwargs)

    def forward_packed(self, input_ids: torch.Tensor, batch: IsoBatch) -> torch.Tensor:
        """Vocab-parallel logits ``[T, V/tp]`` for packed ``input_ids [1, T]``."""
        logits = self.forward(input_ids, position_ids=None, attention_mask=None, packed_seq_params=batch)
        return logits.squeeze(0)

    def forward_hidden(self, input_ids: torch.Tensor, batch: IsoBatch) -> torch.Tensor:
        """The final-norm hidden states ``[T, H]`` of packed ``input_ids [1, T]`` (this rank's rows under
        sequence parallelism), before the LM head: for callers that apply the head themselves, in chunks."""
        self._hidden_only = True
        try:
            hidden = self.forward(input_ids, position_ids=None, attention_mask=None, packed_seq_params=batch)
        finally:
            self._hidden_only = False
        return hidden.squeeze(1)  # [s, b = 1, h]

    def output_weight(self) -> torch.Tensor:
        """The LM head's weight ``[V/tp, H]`` (the word embedding's when they are tied)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def _postprocess(self, hidden_states, *args, **kwargs):
        if getattr(self, "_hidden_only", False):
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)


def block_spec(config: IsoTransformerConfig):
    """MoE layers when the config has experts (``num_moe_experts``), dense layers otherwise; GDN
    token mixers where the config has a linear-attention pattern (hybrid, Qwen3-Next)."""
    gdn = gdn_layer_indices(config)
    if gdn:
        spec = hybrid_block_spec(config.iso_profile, config.num_layers, gdn, moe=bool(config.num_moe_experts))
    else:
        spec = (moe_block_spec if config.num_moe_experts else dense_block_spec)(config.iso_profile, config.num_layers)
    return stage_block_spec(spec, current_stage(config))  # a pipeline stage builds its own layers only


def build_model(config: IsoTransformerConfig, hf_weights: Mapping[str, torch.Tensor] | None = None) -> IsoGPTModel:
    """Build this rank's model (after Megatron's parallel_state is initialised); load full HF-named
    weights into it when given, sharded for this rank's TP position."""
    stage = current_stage(config)
    model = IsoGPTModel(config, pre_process=stage.first, post_process=stage.last)
    if torch.cuda.is_available():
        # Megatron initialises on the CPU (use_cpu_initialization); the model runs where CUDA is.
        model.cuda(torch.cuda.current_device())
    if hf_weights is not None:
        load_hf_state_dict(model, hf_weights, config)
    return model
