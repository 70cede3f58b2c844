"""How the loop asks the decoder for samples: sampling parameters from the ``rl`` settings, and requests spread
over the data-parallel ranks.

The recorded logprob of a sampled token is the trainer's scoring function (``parallel.vocab_scoring.token_logprobs``)
on the step's logits divided by the temperature: the full-vocab log-softmax at that temperature. ``top_k`` /
``top_p`` only narrow which tokens may be drawn; the logprob is not renormalised over the kept ones, so it is the
one the trainer recomputes bit for bit (docs/DATA.md says what that means for the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_iso.inference.params import Request, RequestOutput, SamplingParams
from megatron_iso.settings import RLSettings


def train_params(rl: RLSettings, stop_ids: tuple[int, ...], seed: int) -> SamplingParams:
    """A training rollout's sampling: ``rl.temperature``, ``rl.top_k``, ``rl.top_p``, the stop tokens,
    ``rl.max_response_length``, ``rl.group_size`` samples per prompt."""
    return SamplingParams(
        temperature=rl.temperature,
        top_k=rl.top_k,
        top_p=rl.top_p,
        max_new_tokens=rl.max_response_length,
        stop_token_ids=stop_ids,
        n=rl.group_size,
        seed=seed,
    )


def val_params(rl: RLSettings, stop_ids: tuple[int, ...], seed: int) -> SamplingParams:
    """The validation pass's: greedy at ``rl.val_temperature`` 0, else sampled at it with ``rl.top_k`` /
    ``rl.top_p``; ``rl.val_n`` samples per prompt."""
    sampled = rl.val_temperature > 0
    return SamplingParams(
        temperature=rl.val_temperature,
        top_k=rl.top_k if sampled else 0,
        top_p=rl.top_p if sampled else 1.0,
        max_new_tokens=rl.max_response_length,
        stop_token_ids=stop_ids,
        n=rl.val_n,
        seed=seed,
    )


def generate_shares(trainer: Any, requests_of: Callable[[int], list[Request]]) -> list[RequestOutput]:
    """This rank's outputs for ``requests_of(dp_rank)``. The colocated decoder runs this rank's own requests; a
    decoder in its own layout (``rl.rollout.LayoutRollout``) takes every DP rank's and hands back each rank's."""
    mine = requests_of(trainer.dp_rank)
    memory = trainer.rollout_memory  # the engine's caches, freed between rollouts (rollout.release_in_training)
    if memory is not None:
        memory.restore()
    if trainer.layout_rollout is None:
        outs = trainer.engine.generate(mine)
    else:
        done = trainer.layout_rollout.generate([r for d in range(trainer.dp_size) for r in requests_of(d)])
        outs = [done[r.request_id] for r in mine]
    if memory is not None:
        memory.release()
    for out in outs:
        if out.error:
            raise RuntimeError(f"rollout request {out.request_id} failed: {out.error}")
    return outs
