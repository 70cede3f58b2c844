"""Rollout correction: importance weights and rejection between the behaviour policy the rollout sampled from and
the trainer's old policy (``rl.rollout_correction``; verl's ``algorithm.rollout_correction``).

The importance ratio of a response token is ``r_t = exp(logp_old - logp_rollout)``, where ``logp_old`` is the
trainer's logprob before the update (the forward's own, the rollout's in the correctness profile, or a recompute:
``rl.ppo``). ``level`` says which ratio a token's weight is made of:

- ``token``: its own ``r_t``;
- ``sequence``: the product over its response, ``exp(sum_t log r_t)`` (summed in log space, in float64);
- ``geometric``: the geometric mean over its response, ``exp(mean_t log r_t)``.

The log ratio is bounded to +-``LOG_RATIO_BOUND`` before the one ``exp`` (verl's safety bound: a long response's
product cannot overflow). ``mode`` says what the weight is:

- ``truncate``: ``min(r, upper)`` (truncated importance sampling; verl ``rollout_is`` + ``rollout_is_threshold``);
- ``mask``: 1 inside ``[lower, upper]``; a token (token level) or a whole response (sequence / geometric level)
  outside it is rejected: it leaves the loss and its normaliser (verl ``rollout_rs``);
- ``icepop``: ``r`` inside ``[lower, upper]``, 0 outside (IcePop's band mask: an out-of-band token gets no
  gradient but stays in the normaliser).

In the correctness profile ``logp_old`` equals ``logp_rollout`` bit for bit, so every log ratio is exactly 0,
every weight exactly 1.0 (``exp(0) = 1``; the bounds must hold 1) and nothing is masked.
"""

from __future__ import annotations

import torch

from megatron_iso.settings.correction import RolloutCorrection

# |log ratio| bound before exp (verl's): exp(20) ~ 4.9e8, far above any useful upper bound.
LOG_RATIO_BOUND = 20.0


def level_log_ratio(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, level: str
) -> torch.Tensor:
    """Each row's log importance ratio at ``level`` (float64 ``[T]``; 0 outside ``mask``), bounded to
    +-:data:`LOG_RATIO_BOUND`. Per-sequence sums are one-hot matmuls (no atomics: the same bits every run)."""
    m = mask.to(torch.float64)
    log_ratio = (old_logp.detach().double() - rollout_logp.detach().double()) * m
    if level != "token" and seq_index.numel():
        n = int(seq_index.max()) + 1
        onehot = (seq_index.unsqueeze(0) == torch.arange(n).to(seq_index).unsqueeze(1)).to(torch.float64)
        per_seq = onehot @ log_ratio
        if level == "geometric":
            per_seq = per_seq / (onehot @ m).clamp(min=1.0)
        log_ratio = per_seq[seq_index] * m
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    cfg: RolloutCorrection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, rejected)``, both ``[T]``: the float32 factor of each row's loss term (0 outside ``mask``), and the
    response rows that ``mode=mask`` removes from the loss (all False for the other modes)."""
    ratio = torch.exp(level_log_ratio(old_logp, rollout_logp, mask, seq_index, cfg.level))
    lower, upper = cfg.band
    outside = ((ratio < lower) | (ratio > upper)) & mask
    if cfg.mode == "truncate":
        weight = ratio.clamp(max=upper)
    elif cfg.mode == "mask":
        weight = torch.ones_like(ratio)
    elif cfg.mode == "icepop":
        weight = ratio
    else:
        weight = torch.ones_like(ratio)
    if cfg.mode in ("mask", "icepop"):
        weight = weight.masked_fill(outside, 0.0)
    weight = weight.masked_fill(~mask, 0.0).float()
    return weight, outside if cfg.mode == "mask" else torch.zeros_like(outside)


def correction_stats(weight: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The correction's metrics over the response rows (``mask``) of ``weight`` (:func:`correction_weights`):

    - ``rollout_correction/masked_frac``: share of response tokens whose weight is 0 (rejected or out of band);
    - ``rollout_correction/weight_mean``, ``.../weight_max``: of the per-token weights, rejected ones as 0;
    - ``rollout_correction/ess``: normalised effective sample size ``(sum w)^2 / (n sum w^2)``: 1 when every weight
      is equal, 1/n when one token carries all; 0 when every token is masked.
    """
    w = weight[mask].double()
    n = w.numel()
    if n == 0:
        return {}
    total, squares = float(w.sum()), float((w * w).sum())
    return {
        "rollout_correction/masked_frac": float((w == 0).double().mean()),
        "rollout_correction/weight_mean": total / n,
        "rollout_correction/weight_max": float(w.max()),
        "rollout_correction/ess": total * total / (n * squares) if squares > 0 else 0.0,
    }
