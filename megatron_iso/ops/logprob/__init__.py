"""Log-softmax family (token logprob, entropy, full log-softmax): one dispatch point.

| device | profile     | implementation                                                     |
|--------|-------------|--------------------------------------------------------------------|
| cpu    | correctness | ``reference.VocabScores`` (leaf tree over vocab, invariant)         |
| cuda   | correctness | ``logprob_triton.TritonScores``: the same leaf tree, each leaf's sum |
|        |             | in one kernel pass (no fp32 [rows, vocab] copy for a token logprob)  |
| any    | performance | ``native.NativeScores`` (torch.log_softmax over the gathered vocab)  |

The entropy statistic on CUDA (correctness profile) is ``entropy.row_entropy``: one pass per vocab leaf
(``entropy_triton``) instead of the leaf tree's fp32 log-softmax; a logged metric, no logprob depends on it.
The public, group-aware scoring API is ``megatron_iso.parallel.vocab_scoring`` (token_logprobs, ...).
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.dispatch import select
from megatron_iso.ops.gemm.reference import DEFAULT_LEAVES
from megatron_iso.ops.logprob.backend import Scores
from megatron_iso.ops.logprob.native import NativeScores, entropy_native, log_softmax_native, token_logprobs_native
from megatron_iso.ops.logprob.reference import (
    Comm,
    LocalShards,
    VocabScores,
    entropy_shards,
    host_checked_temperature,
    log_softmax_shards,
    scale_logits,
    token_logprobs_shards,
)
from megatron_iso.registry import OpImpl, Profile, register, register_per_device

OP = "logprob"
TRITON_MODULE = "megatron_iso.ops.logprob.logprob_triton"

__all__ = [
    "OP",
    "TRITON_MODULE",
    "Comm",
    "LocalShards",
    "NativeScores",
    "VocabScores",
    "entropy_native",
    "entropy_shards",
    "host_checked_temperature",
    "log_softmax_native",
    "log_softmax_shards",
    "scale_logits",
    "token_logprobs_native",
    "token_logprobs_shards",
    "vocab_scores",
]


def vocab_scores(
    logits: torch.Tensor,
    comm: Comm,
    *,
    temperature: float | torch.Tensor = 1.0,
    leaves: int = DEFAULT_LEAVES,
    valid_vocab: int | None = None,
    profile: str = Profile.CORRECTNESS,
) -> VocabScores | NativeScores:
    """Row statistics of ``logits`` [R, ..., V/C] (R local vocab shards) by the registered implementation
    for the device class and profile (``ops.common.dispatch.select``, so a registry swap reaches scoring); query
    ``.token_logprobs(ids)``, ``.entropy()``, ``.log_softmax()``."""
    if profile not in (Profile.CORRECTNESS, Profile.PERFORMANCE):
        raise ValueError(f"profile={profile!r}; expected 'correctness' or 'performance'")
    fn: Scores = select(OP, logits, profile, TRITON_MODULE)
    return fn(logits, comm, temperature=temperature, leaves=leaves, valid_vocab=valid_vocab)


def _reference_scores(
    logits: torch.Tensor, comm: Comm, *, temperature: float | torch.Tensor, leaves: int, valid_vocab: int | None
) -> VocabScores:
    return VocabScores(logits, comm, temperature=temperature, leaves=leaves, valid_vocab=valid_vocab)


def _native_scores(
    logits: torch.Tensor, comm: Comm, *, temperature: float | torch.Tensor, leaves: int, valid_vocab: int | None
) -> NativeScores:
    del leaves  # torch.log_softmax has no leaf tree
    return NativeScores(logits, comm, temperature=temperature, valid_vocab=valid_vocab)


def _probe_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    logits = torch.randn(5, 256, generator=g) * 3
    targets = torch.randint(0, 256, (5,), generator=g)
    return logits, targets


def _probe(fn):
    def probe() -> dict[str, torch.Tensor]:
        logits, targets = _probe_inputs()
        out = {}
        for name, x in (("fp32", logits), ("bf16", logits.bfloat16())):
            s = fn(x.unsqueeze(0))
            out[f"{name}.logp"] = s.token_logprobs(targets)
            out[f"{name}.entropy"] = s.entropy()
            out[f"{name}.temp0.7"] = fn(x.unsqueeze(0), temperature=0.7).token_logprobs(targets)
        return out

    return probe


def _ref(x, temperature=1.0):
    return VocabScores(x, LocalShards(1), temperature=temperature, leaves=DEFAULT_LEAVES)


def _nat(x, temperature=1.0):
    return NativeScores(x, LocalShards(1), temperature=temperature)


register(
    OpImpl(
        op=OP,
        impl_id="vocab_logprob.reference",
        version="1",
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=_reference_scores,
        constants={
            "default_leaves": DEFAULT_LEAVES,
            "accumulate": "fp32",
            "temperature": "fp32_true_division",
            "max": "exact_all_reduce_max",
            "exp_sum": "leaf_balanced_tree",
            "entropy": "neg_sum_p_logp_leaf_tree",
        },
        probe=_probe(_ref),
    )
)
register_per_device(
    op=OP,
    impl_id="vocab_logprob.native",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=_native_scores,
    constants={"algorithm": "torch_log_softmax_gathered_vocab"},
    # The probe's inputs are CPU tensors whatever the device, so only the CPU entry carries it.
    probe_for=lambda device: _probe(_nat) if device == "cpu" else None,
)
