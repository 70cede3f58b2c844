"""The rollout engine's settings (:class:`EngineConfig`) and its running counters (:class:`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """kv_cache_bytes: memory budget of the paged KV cache (this rank). block_size: tokens per
    block. max_num_seqs: running samples per step. max_prefill_tokens: prompt tokens admitted per
    step (a longer single prompt is still admitted alone). max_model_len: prompt + generated
    limit (default: the model's max_sequence_length). progress: tqdm bar in :meth:`generate`.
    paged_kv_reads: where the attention kernel can read the paged pool in place (the Triton kernel,
    CUDA + correctness), let it; False stages each layer's history instead (same bits; a fallback).
    cuda_graphs: replay decode steps from CUDA graphs where :func:`~megatron_iso.inference.cuda_graphs.
    decode_graph_support` allows (:attr:`RolloutEngine.decode_graphs_off` says why not); the correctness
    profile gives the eager bits, the performance profile's last bits may move with the padding.
    Hybrid models also hold ``max_num_seqs`` GDN state slots (one per running sample).
    lookahead: while no request waits for admission, launch decode step n + 1 before reading step n's tokens
    (the next step's input ids come from the device): the host's bookkeeping of step n overlaps the GPU's step
    n + 1. A sample that stops on a stop token gets one extra row computed and dropped; outputs are unchanged.
    record_routing: MoE models: keep each token's top-k experts per layer beside its keys and hand every sample's
    on its output (``SampleOutput.routing``; ``inference.routing_record``, for ``rl.routing_replay``)."""

    kv_cache_bytes: int = 64 << 20
    block_size: int = 16
    max_num_seqs: int = 64
    max_prefill_tokens: int = 4096
    max_model_len: int | None = None
    prefix_caching: bool = True
    progress: bool = False
    paged_kv_reads: bool = True
    cuda_graphs: bool = True
    lookahead: bool = True
    record_routing: bool = False


@dataclass
class EngineStats:
    steps: int = 0
    idle_steps: int = 0  # lockstep forwards of padding rows only, while a peer rank decodes (not in ``steps``)
    prefill_tokens: int = 0  # prompt tokens run through the model (prefix hits excluded)
    decode_tokens: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    forward_seconds: float = 0.0
