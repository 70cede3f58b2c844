"""The bundled decoder: a rollout engine over the trainer's own modules (see docs/DECODER.md)."""

from megatron_iso.inference.engine import EngineConfig, EngineStats, RolloutEngine
from megatron_iso.inference.kv_blocks import PagedKVCache
from megatron_iso.inference.params import Request, RequestOutput, SampleOutput, SamplingParams
from megatron_iso.inference.state import SequenceStateCache, StepState

__all__ = [
    "EngineConfig",
    "EngineStats",
    "PagedKVCache",
    "Request",
    "RequestOutput",
    "RolloutEngine",
    "SampleOutput",
    "SamplingParams",
    "SequenceStateCache",
    "StepState",
]
