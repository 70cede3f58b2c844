"""Policy-gradient objectives over packed token rows: GRPO and DAPO (plus optional KL and rollout correction).

Shapes: every per-token tensor is ``[T]`` over the packed rows the trainer scored; ``mask`` marks
response tokens (the ones the policy generated); ``seq_index [T]`` says which sample a token
belongs to. Advantages are per sample, broadcast to its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_iso.rl.correction import RolloutCorrection, correction_stats, correction_weights
from megatron_iso.settings.rl import AGGREGATIONS, ALGOS


@dataclass(frozen=True)
class PolicyLossConfig:
    algo: str = "grpo"
    clip_low: float = 0.2  # ratio lower bound 1 - clip_low
    clip_high: float = 0.2  # ratio upper bound 1 + clip_high (DAPO's clip-higher: larger than clip_low)
    aggregation: str = "seq_mean_token_mean"  # DAPO uses token_mean
    kl_coef: float = 0.0  # k3 KL to a reference policy's logprobs, 0 = off
    # Importance weights / rejection on pi_train_old / pi_rollout (rl.rollout_correction; rl.tis_cap: truncate).
    correction: RolloutCorrection = field(default_factory=RolloutCorrection)

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"rl.algo={self.algo!r} is not allowed; allowed values: {list(ALGOS)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"rl.aggregation={self.aggregation!r} is not allowed; allowed values: {list(AGGREGATIONS)}"
            )
        for name in ("clip_low", "clip_high", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"rl.{name}={getattr(self, name)} must be >= 0")


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, over the group's std (+eps) when asked.

    ``rewards [G * group_size]`` ordered group by group.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=False) + 1e-6)
    return adv.reshape(-1).float()


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: True for groups whose rewards are not all equal (all right/all wrong
    groups give zero advantage and only dilute the batch)."""
    r = rewards.view(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def untrained_step_line(step: int, groups: int, gen_batches: int = 1) -> str:
    """The one line a step prints when dynamic sampling kept no group on any rank (no loss, no update)."""
    batch = f"{gen_batches} generation batch" + ("es" if gen_batches > 1 else "")
    return (
        f"step {step}: no update: dynamic sampling (rl.dynamic_sampling) dropped all {groups} groups of {batch} "
        f"(rl.max_gen_batches={gen_batches}; every sample of each group got the same reward), so the step trains "
        f"nothing and logs no loss; rl.max_gen_batches={gen_batches + 1} or more re-samples further before giving up"
    )


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to ``max_len - buffer``, then linear down to ``-penalty``."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0) / buffer
    return -penalty * over.clamp(max=1.0)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def loss_normaliser(mask: torch.Tensor, seq_index: torch.Tensor, aggregation: str) -> float:
    """The aggregation's denominator: response tokens (``token_mean``) or sequences holding at least
    one (``seq_mean_token_mean``), at least 1. Computed once over a whole step and passed to every
    micro-batch's :func:`policy_loss`, the micro-batch losses (and gradients) add up to the step's.
    With ``rl.rollout_correction.mode=mask``, ``mask`` is the response rows the correction kept."""
    if aggregation == "token_mean":
        return float(max(1, int(mask.sum())))
    return float(max(1, int(seq_index[mask].unique().numel())))


def _aggregate(
    values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, how: str, normaliser: float
) -> torch.Tensor:
    m = mask.float()
    if how == "token_mean":
        return (values * m).sum() / normaliser
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    # A one-hot matmul instead of index_add: index_add uses atomics on GPU (nondeterministic backward).
    # ``.to(seq_index)``: the sample ids on seq_index's device (the trainer's loss runs on the host).
    onehot = (seq_index.unsqueeze(0) == torch.arange(n).to(seq_index).unsqueeze(1)).to(values.dtype)
    per_seq = onehot @ (values * m)
    count = onehot @ m
    has = count > 0
    return (per_seq[has] / count[has]).sum() / normaliser if bool(has.any()) else values.sum() * 0.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss (to minimise) and its statistics.

    ``old_logp`` is the behaviour policy's logprob as the trainer computes it; in the correctness
    profile it equals the rollout's bit for bit. With ``cfg.correction`` on, each token's term is
    multiplied by its weight of :func:`megatron_iso.rl.correction.correction_weights` on
    ``exp(old_logp - rollout_logp)`` (exactly 1.0 where the two agree), and ``mode=mask``'s rejected
    tokens leave the aggregation. ``normaliser`` (default: this batch's :func:`loss_normaliser` over the
    kept tokens) divides the aggregated loss; a micro-batch passes its whole step's, so its loss is its
    share of the step's loss. The statistics are this batch's own.
    """
    adv = advantages[seq_index]
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    stats: dict[str, float] = {}
    kept = mask
    if cfg.correction.active:
        if rollout_logp is None:
            raise ValueError(f"rl.rollout_correction.mode={cfg.correction.mode} needs the rollout logprobs")
        weight, rejected = correction_weights(old_logp, rollout_logp, mask, seq_index, cfg.correction)
        per_token = per_token * weight
        kept = mask & ~rejected
        stats |= correction_stats(weight, mask)
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("rl.kl_coef > 0 needs reference-policy logprobs")
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + cfg.kl_coef * kl
        stats["kl/ref_k3"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
    if normaliser is None:
        normaliser = loss_normaliser(kept, seq_index, cfg.aggregation)
    elif not normaliser > 0:
        raise ValueError(f"policy_loss: normaliser={normaliser} must be > 0 (a token or sequence count)")
    loss = _aggregate(per_token, kept, seq_index, cfg.aggregation, normaliser)
    with torch.no_grad():
        out_of_band = ((ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)) & mask
        stats["policy/clip_frac"] = float(out_of_band.float().sum() / mask.float().sum().clamp(min=1))
    return loss, stats
