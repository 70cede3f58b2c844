"""Token selection, batch invariant by construction: a row's token depends on that row's logits and key alone.

Two rules, chosen per row (so a row's token never depends on what else shares its step):

- **Gumbel-max** (:func:`gumbel_tokens`) for rows without top-k / top-p, and for greedy rows: the token is the
  argmax over the vocab of ``logit / T + G``, ``G = -log(-log u)`` with one counter-based uniform per (row key,
  token id); ties go to the lowest id; greedy rows take the argmax of the logits. An exact draw from
  ``softmax(logits / T)`` with no sort and no prefix sum, one pass over the logits, vocab-parallel (a TP rank
  scores its own shard; the noise is keyed by the global token id, so every layout draws the same token), and
  the same bits on the CPU reference and the Triton kernel (``sampler_triton``: float64 from correctly rounded
  operations only).
- **Filtered** (:func:`select_tokens`) for rows with top-k or top-p: from full-vocab fp32 log-probabilities,
  a stable descending sort (ties by ascending token id), probabilities ``iso_exp(logp)``,
top-k / top-p masks on the sorted order, then inverse-CDF with one counter-based uniform. The
cumulative sums are a Hillis-Steele scan (log2(V) rounds of shifted elementwise adds): a fixed
addition pattern per row, the same on every device and for any number of rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_iso.inference.rng import token_words
from megatron_iso.ops.common.ieee_math import iso_exp, log64
from megatron_iso.parallel.tree_collectives import all_gather_list


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


def gumbel_partials_reference(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    *,
    id_offset: int,
    valid_vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel-max scores of a vocab shard in float64 torch ops (CPU tensors), the row's best score and
    lowest id reaching it (``[R, 1]`` each, the Triton kernel's partials with one slice)."""
    rows, n_local = logits.shape
    ids = torch.arange(id_offset, id_offset + n_local, dtype=torch.int64)
    scaled = (logits.float() / temperature.float().reshape(rows, 1)).double()
    u = ((token_words(keys, ids) >> 8).double() + 0.5) * 2.0**-24
    noise = -log64(-log64(u))
    s = torch.where(greedy.reshape(rows, 1), scaled, scaled + noise)
    s = torch.where((ids < valid_vocab) & (s == s), s, torch.full_like(s, float("-inf")))
    best, at = s.max(dim=-1, keepdim=True)  # first (lowest-id) maximum
    best_id = torch.where(torch.isinf(best) & (best < 0), id_offset + n_local, at + id_offset)
    return best, best_id


def gumbel_tokens(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    *,
    valid_vocab: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sampled token id per row by Gumbel-max (module doc). ``logits [R, V/C]``: this rank's vocab shard of
    TP group ``group`` (the full vocab without one); ``keys [R, 2]`` int64 from ``rng.row_keys``;
    ``temperature [R]`` > 0 (greedy rows: any); ``greedy [R]`` bool; ids >= ``valid_vocab`` are never drawn."""
    size = 1 if group is None else dist.get_world_size(group)
    n_local = logits.shape[-1]
    offset = 0 if size == 1 else dist.get_rank(group) * n_local
    limit = n_local * size if valid_vocab is None else valid_vocab
    temperature = torch.where(greedy.reshape(temperature.shape), torch.ones_like(temperature), temperature)
    if logits.is_cuda:
        from megatron_iso.inference.sampler_triton import gumbel_partials_triton as partials
    else:
        partials = gumbel_partials_reference
    best, best_id = partials(logits, keys, temperature, greedy, id_offset=offset, valid_vocab=limit)
    if size > 1:  # [R, slices] per shard, the same shape on every rank: an all-gather a CUDA graph records
        best = torch.cat(all_gather_list(best, group), dim=-1)
        best_id = torch.cat(all_gather_list(best_id, group), dim=-1)
    # Slices in ascending id order: the first maximum is the lowest id among equal scores. A row with no
    # finite score (NaN logits) gets token 0: its recorded logprob is NaN, which the run's checks catch.
    token = best_id.gather(-1, best.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where(token < limit, token, torch.zeros_like(token))
