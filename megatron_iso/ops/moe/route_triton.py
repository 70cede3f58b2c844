"""The correctness profile's MoE router in one Triton launch: softmax, top-k, renormalisation and the scattered
``(routing_map, probs)`` pair of :mod:`.reference`, with its bits.

Why: composed from torch ops the router is about fifteen small kernels per MoE layer (max, subtract, the
IEEE-composed exp, the tree sum, a float sort, an index sort, a gather, a second tree sum, two scatters). In a
decode step of a few dozen tokens each is a launch of a few microseconds, so the router alone is a large share of
the MoE layer's glue. One program here handles ``BLOCK_N`` rows: every operation is the reference's, per row, so
the result does not depend on the block, the grid or the batch:

- softmax: exact max, one fp32 subtraction, ``exp64`` of the widened value rounded once (``ieee_math.iso_exp``),
  the fixed tree over the E columns (``tree_triton.fixed_tree_rowsum``), one ``div_rn``;
- top-k: k rounds of "the largest remaining probability, the lowest expert index among equals" pick the set a
  stable descending sort picks;
- the chosen experts in ascending index (the combine order) by their rank in the row's selection mask; their
  probabilities copied, renormalised by the fixed tree over k and one ``div_rn`` (``norm_topk_prob``).

Served: fp32 logits ``[N, E]`` without autograd (rollout and scoring; the trainer's forward keeps the torch
composition, whose autograd is the router's backward), E and k powers of two, ``E <= 1024``, ``k <= 16``; other
shapes take the reference. Logits are finite (a NaN row's choice of experts is unspecified here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.ieee_math_triton import NO_FMA, exp64
from megatron_iso.ops.common.interpret import INTERPRET
from megatron_iso.ops.common.tree_triton import MAX_TREE_COLUMNS, fixed_tree_rowsum

MAX_TOPK = 16
# Rows per program = this / E (at most 32). The tile's size, not the arithmetic, sets the compile time: on an H100
# [32, 64] and [32, 128] tiles compiled for minutes, [4, 128] and [32, 32] in about 3 s. Any block gives the same bits.
_ROW_ELEMENTS = 512


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def serves(logits: torch.Tensor, k: int) -> bool:
    """Whether :func:`route_triton` computes this call (see the module doc for why the others do not)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or not (logits.is_cuda or INTERPRET):
        return False
    if torch.is_grad_enabled() and logits.requires_grad:
        return False
    e = logits.shape[1]
    return _pow2(e) and 2 <= e <= MAX_TREE_COLUMNS and _pow2(k) and k <= min(e, MAX_TOPK)


@triton.jit
def _route_kernel(
    logits_ptr,
    scores_ptr,
    probs_ptr,
    map_ptr,
    weights_ptr,
    experts_ptr,
    n_rows,
    E: tl.constexpr,
    K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n_rows
    cols = tl.arange(0, E)
    at = rows.to(tl.int64)[:, None] * E + cols[None, :]
    mask = live[:, None]
    x = tl.load(logits_ptr + at, mask=mask, other=0.0)
    shifted = x - tl.max(x, axis=1)[:, None]  # the max is exact in any order; one rounding per entry
    e = exp64(shifted.to(tl.float64)).to(tl.float32)
    p = tl.math.div_rn(e, fixed_tree_rowsum(e, BLOCK_N, E)[:, None])
    tl.store(scores_ptr + at, p, mask=mask)

    # k rounds: the largest remaining probability, ties to the lowest index (a stable descending sort's order).
    chosen = tl.zeros((BLOCK_N, E), dtype=tl.int32) != 0
    remaining = p
    for _ in tl.static_range(K):
        best = tl.max(remaining, axis=1)
        first = tl.min(tl.where(remaining == best[:, None], cols[None, :], E), axis=1)
        hit = cols[None, :] == first[:, None]
        chosen = chosen | hit
        remaining = tl.where(hit, -1.0, remaining)  # probabilities are >= 0: a taken column never wins again
    rank = tl.cumsum(chosen.to(tl.int32), axis=1) - 1  # slot of each chosen expert in ascending index order

    # The k weights in slot order, laid out [BLOCK_N, K] for the tree over k.
    slots = tl.arange(0, K)
    w = tl.zeros((BLOCK_N, K), dtype=tl.float32)
    for j in tl.static_range(K):
        in_slot = chosen & (rank == j)
        wj = tl.max(tl.where(in_slot, p, -1.0), axis=1)  # the one chosen entry, copied
        w = tl.where(slots[None, :] == j, wj[:, None], w)
    if NORMALIZE:
        if K == 1:  # noqa: SIM108 - a constexpr branch: Triton compiles only the chosen one
            total = tl.reshape(w, (BLOCK_N,))
        else:
            total = fixed_tree_rowsum(w, BLOCK_N, K)
        w = tl.math.div_rn(w, total[:, None])

    probs = tl.zeros((BLOCK_N, E), dtype=tl.float32)
    for j in tl.static_range(K):
        in_slot = chosen & (rank == j)
        wj = tl.max(tl.where(slots[None, :] == j, w, -1.0), axis=1)  # weights are >= 0: column j exactly
        ej = tl.min(tl.where(in_slot, cols[None, :], E), axis=1)
        probs = tl.where(in_slot, wj[:, None], probs)
        tl.store(weights_ptr + rows.to(tl.int64) * K + j, wj, mask=live)
        tl.store(experts_ptr + rows.to(tl.int64) * K + j, ej.to(tl.int64), mask=live)
    tl.store(probs_ptr + at, probs, mask=mask)
    tl.store(map_ptr + at, chosen.to(tl.uint8), mask=mask)


def route_triton(
    logits: torch.Tensor, k: int, *, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores [N, E], weights [N, k], experts [N, k], routing_map [N, E] bool, probs [N, E])`` of fp32
    ``logits [N, E]``: :func:`.reference.router_probs`, :func:`.reference.top_k_route` and the scatters of
    ``models.moe.IsoTopKRouter``, bit for bit, in one launch. Only for calls :func:`serves` accepts."""
    if not serves(logits, k):
        raise ValueError(
            f"route_triton: logits {tuple(logits.shape)} {logits.dtype} on {logits.device} with k={k} is not served "
            f"(fp32 [N, E] without autograd, E and k powers of two, E <= {MAX_TREE_COLUMNS}, k <= {MAX_TOPK})"
        )
    logits = logits.contiguous()
    n, e = logits.shape
    scores = torch.empty_like(logits)
    probs = torch.empty_like(logits)
    routing_map = torch.empty((n, e), dtype=torch.bool, device=logits.device)
    weights = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    experts = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n:
        block_n = max(1, min(32, _ROW_ELEMENTS // e))
        _route_kernel[(triton.cdiv(n, block_n),)](
            logits,
            scores,
            probs,
            routing_map.view(torch.uint8),
            weights,
            experts,
            n,
            E=e,
            K=k,
            NORMALIZE=normalize,
            BLOCK_N=block_n,
            num_warps=4,
            **NO_FMA,
        )
    return scores, weights, experts, routing_map, probs
