"""The trainer's forward and backward over pipeline stages (``parallel.pp`` > 1), through Megatron-Core's schedule.

Every stage packs the same micro-batches (the samples are on every rank of a pipeline). Megatron's
``get_forward_backward_func`` (1F1B, non-interleaved) runs them: the first stage embeds the tokens, every stage
runs its own layers on the hidden states the stage before it sent, the last stage applies the final norm, the
invariant LM head and ``token_logprobs`` on the response rows (``models.scoring.score_sequences``) and the
policy loss; the backward goes the other way. The layers and their order are the unpipelined model's, each
stage's forward and backward are its part of the same autograd graph, and the hidden states and their
gradients cross stages as they are: the logprobs, the loss and every parameter's gradient are those of
``parallel.pp=1`` bit for bit (the logprobs and gradients do not depend on where the model is cut).

Megatron divides each micro-batch's loss by the micro-batch count unless ``calculate_per_token_loss`` is set;
the loop's loss is already divided by the whole step's normaliser (``rl.losses.loss_normaliser``), so the
schedule runs with that flag on and receives a token count of 1 (the loss passes through unchanged). The last
stage's logprobs and statistics are broadcast to the other stages, so every rank reports the same step.

Megatron's own grad norm would sum each stage's partial norm over the pipeline (another summation order than
one norm over all parameters: a clip factor, hence every later step, off in the last bits); the trainer's
optimizer joins the stages' per-tensor norms in the unpipelined order instead (``rl.optim.join_stage_grad_norms``),
so the grad norm, the clipped update and every later step are PP 1's too. On the CPU the comparison holds at an
equal thread count per rank (the fp32 GEMMs of the backward sum in a thread-dependent order).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_iso.models.batch import pack, row_multiple
from megatron_iso.models.scoring import score_sequences
from megatron_iso.rl.losses import policy_loss
from megatron_iso.rl.routing_replay import attach_routing


def join_stage_shards(shards: list[dict[str, torch.Tensor]], group: Any) -> list[dict[str, torch.Tensor]]:
    """Every pipeline stage's TP shards (whole-model names) joined: ``shards[t]`` of each stage merged, for every
    TP rank ``t``; a collective over the pipeline ``group`` (the rollout model is not pipelined and loads all)."""
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, [{n: t.cpu() for n, t in s.items()} for s in shards], group=group)
    device = next(iter(shards[0].values())).device
    return [{n: t.to(device) for stage in stages for n, t in stage[i].items()} for i in range(len(shards))]


def pack_micro_batch(trainer: Any, samples: Sequence[Any], advantages: torch.Tensor, weight: float) -> dict[str, Any]:
    """One micro-batch of the trainer's step packed (case ``trainer_forward``), for ``Trainer._accumulate_grads`` and
    the pipeline alike: ``ids`` and ``batch`` of the prompt+response rows, the response rows' ``mask``, each row's
    sample (``seq_index``), the rollout's logprobs on the response rows (``rollout``), the old policy's (``old``;
    None unless every sample carries one: ``rl.ppo``), ``advantages``, ``weight``.

    The layout comes from the host lengths (reading ``cu_seqlens`` back would be a device sync), and the token ids
    are checked against the vocab on the host (``pack(vocab_size=...)``: the scoring does not read them back). At
    expert parallel size 1 the batch is marked ``static_shapes``: MoE layers route and run their experts without
    host reads (``models.moe``), the same bits as their eager path."""
    seqs = [s.prompt.ids + s.tokens for s in samples]
    tc = trainer.tc
    ids, batch = pack(seqs, pad_to_multiple=row_multiple(tc), device=trainer.device, vocab_size=tc.vocab_size)
    batch.static_shapes = bool(tc.num_moe_experts) and tc.expert_model_parallel_size == 1
    rows = ids.shape[1]
    mask = torch.zeros(rows, dtype=torch.bool)
    seq_index = torch.zeros(rows, dtype=torch.long)
    rollout = torch.zeros(rows, dtype=torch.float32)
    old = torch.zeros(rows, dtype=torch.float32) if all(s.old_logp is not None for s in samples) else None
    starts = [0, *itertools.accumulate(len(s) for s in seqs)]
    attach_routing(batch, samples, starts, trainer.rl.routing_replay)  # the rollout's experts (rl.routing_replay)
    trainer.routing_meter.track(batch, weight)
    for i, s in enumerate(samples):
        seq_index[starts[i] : starts[i + 1]] = i
        # Row t scores token t+1: the response tokens are scored by rows P-1 .. P+R-2.
        r = torch.arange(starts[i] + len(s.prompt.ids) - 1, starts[i] + len(s.prompt.ids) - 1 + len(s.tokens))
        mask[r] = True
        rollout[r] = torch.tensor(s.rollout_logp, dtype=torch.float32)
        if old is not None:
            old[r] = s.old_logp
    return {"ids": ids, "batch": batch, "mask": mask, "seq_index": seq_index, "rollout": rollout, "old": old,
            "advantages": advantages, "weight": weight}  # fmt: skip


def score_micro_batch(
    model: torch.nn.Module, mb: dict[str, Any], temperature: float, device: torch.device, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logprobs (and entropies, ``with_entropy``) of a packed micro-batch (:func:`pack_micro_batch`) at the
    sampling ``temperature``, the way the trainer scores every forward (unpipelined, pipelined, a reference or an
    old policy): only the response rows enter the loss, so only they are scored (the prompt's LM head is skipped)."""
    rows = mb["mask"].nonzero()[:, 0].to(device)
    return score_sequences(model, mb["ids"], mb["batch"], with_entropy=with_entropy, temperature=temperature, rows=rows)


def pipeline_passes(
    trainer: Any,
    samples: Sequence[Any],
    advantages: torch.Tensor,
    normaliser: float,
    bounds: Sequence[tuple[int, int]],
    passes: int,
    filler: Any,
) -> list[tuple[torch.Tensor, torch.Tensor, None, torch.Tensor, torch.Tensor]]:
    """``passes`` micro-batches (``bounds`` of ``samples``, then ``filler`` passes with loss x 0) forward and
    backward through the pipeline; gradients accumulate in the stage's grad buffers. Returns, on every stage,
    each real micro-batch's response tokens' (trainer logprobs, rollout logprobs, None, entropies, old logprobs) as
    ``Trainer._accumulate_grads`` does (no reference model: rl.kl_coef > 0 is refused with a pipeline)."""
    micro = [
        pack_micro_batch(trainer, samples[a:b], advantages[a:b], 1.0) if j < len(bounds)
        else pack_micro_batch(trainer, [filler], torch.zeros(1), 0.0)
        for j, (a, b) in enumerate([*bounds, *[(0, 0)] * (passes - len(bounds))])
    ]  # fmt: skip
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    with_entropy = trainer.rl.log_entropy
    parts: list[tuple[torch.Tensor, torch.Tensor, None, torch.Tensor, torch.Tensor]] = []

    def forward_step(data: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data)
        if not last:  # the hidden states [s, 1, h] for the next stage
            return model(mb["ids"], position_ids=None, attention_mask=None, packed_seq_params=mb["batch"]), None
        logp, ent = score_micro_batch(model.module, mb, trainer.rl.temperature, trainer.device, with_entropy)
        mask = mb["mask"]
        ent = torch.zeros(0) if ent is None else ent.detach().float().cpu()[mask]

        def loss_func(scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            logp = scored.float().cpu()
            old = logp.detach() if mb["old"] is None else mb["old"]  # None: one update, pi_old is this forward's
            loss, _ = policy_loss(
                logp, old, mb["advantages"], mask, mb["seq_index"], trainer.loss_cfg,
                rollout_logp=mb["rollout"], normaliser=normaliser,
            )  # fmt: skip
            if mb["weight"] == 1.0:
                parts.append((logp.detach()[mask], mb["rollout"][mask], None, ent, old[mask]))
            return (loss * mb["weight"] if mb["weight"] != 1.0 else loss), torch.ones((), dtype=torch.int), {}

        return logp, loss_func

    config = trainer.tc
    saved = (config.calculate_per_token_loss, config.variable_seq_lengths)
    # Per-token: the schedule leaves each micro-batch's loss as the loop normalised it. Variable lengths: the
    # packed micro-batches differ in rows, so the stages exchange each hidden state's shape first.
    config.calculate_per_token_loss, config.variable_seq_lengths = True, True
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[trainer.ddp],
            num_microbatches=len(micro),
            seq_length=max(mb["ids"].shape[1] for mb in micro),
            micro_batch_size=1,
            forward_only=False,
        )
    finally:
        config.calculate_per_token_loss, config.variable_seq_lengths = saved
    box = [parts if last else None]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]
