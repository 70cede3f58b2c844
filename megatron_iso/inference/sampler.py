"""Token selection from full-vocab fp32 log-probabilities, batch invariant by construction.

Per row: a stable descending sort (ties by ascending token id), probabilities ``iso_exp(logp)``,
top-k / top-p masks on the sorted order, then inverse-CDF with one counter-based uniform. The
cumulative sums are a Hillis-Steele scan (log2(V) rounds of shifted elementwise adds): a fixed
addition pattern per row, the same on every device and for any number of rows.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.ieee_math import iso_exp


def inclusive_scan(x: torch.Tensor) -> torch.Tensor:
    """Prefix sums along the last dim with a fixed (row-local, batch-independent) addition order.

    Round r (shift 2^r): ``y[i] = x[i] + x[i - shift]`` for ``i >= shift``, else ``x[i]``. Two
    buffers take turns (the sum is written straight into the other buffer and only the first
    ``shift`` entries are copied), so a round is one add and one short copy over the row instead of
    a clone, an add and a copy: the same additions, so the same bits, with about a third of the
    memory traffic on a full-vocab row.
    """
    src = x.clone()
    dst = torch.empty_like(src)
    shift = 1
    while shift < src.shape[-1]:
        dst[..., :shift] = src[..., :shift]
        torch.add(src[..., shift:], src[..., :-shift], out=dst[..., shift:])
        src, dst, shift = dst, src, shift * 2
    return src


def sort_desc(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted values and token ids, descending; equal values keep ascending token id (stable sort)."""
    return torch.sort(logp, dim=-1, descending=True, stable=True)


def select_tokens(
    logp: torch.Tensor,
    uniform: torch.Tensor,
    *,
    greedy: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Sampled token id per row.

    logp ``[R, V]`` fp32 temperature-scaled log-probabilities (the full vocab); uniform ``[R]`` in
    [0, 1); greedy ``[R]`` bool; top_k ``[R]`` int (0 = off); top_p ``[R]`` fp32 in (0, 1].
    """
    vals, ids = sort_desc(logp)
    v = vals.shape[-1]
    p = iso_exp(vals)
    rank = torch.arange(v, device=logp.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).unsqueeze(-1)
    cum = inclusive_scan(p)
    exclusive = torch.zeros_like(cum)
    exclusive[..., 1:] = cum[..., :-1]
    # Keep a token while the mass before it is < top_p: the smallest prefix reaching top_p; rank 0 always.
    keep = (rank < k) & ((exclusive < top_p.to(torch.float32).unsqueeze(-1)) | (rank == 0))
    kept = torch.where(keep, p, torch.zeros_like(p))
    cdf = inclusive_scan(kept)
    threshold = uniform.to(torch.float32) * cdf[..., -1]
    # The first kept rank whose cdf exceeds the threshold (a count of exact comparisons).
    pick = (cdf <= threshold.unsqueeze(-1)).sum(-1)
    last_kept = keep.sum(-1) - 1
    pick = torch.minimum(pick, last_kept)
    pick = torch.where(greedy, torch.zeros_like(pick), pick)
    return ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def top_logprobs(logp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest logprobs per row and their token ids (ties to the lower id)."""
    vals, ids = sort_desc(logp)
    return ids[..., :n], vals[..., :n]
