"""Vocab row statistics in Triton: the CUDA correctness profile's scoring (token logprob, log-softmax).

The log-sum-exp of ``z = logits.float() / t`` over the reference's vocab leaves, each leaf read once: per (row, leaf)
a lane-wise running-max sum and the fixed lane tree; then the leaf tree across leaves and ranks and
``lse = m + log(s)`` (:func:`_row_stats_kernel`, no FMA contraction); then ``z_target - lse``. Invariant kept: a
row's bits come from its own leaves in an order fixed by the leaf length and BLOCK: the same for any batch and any TP
split of the vocab. Its own contract implementation (not the torch reference's bits).

Design: docs/KERNELS.md, "Vocab scoring kernels".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.ieee_math_triton import NO_FMA
from megatron_iso.ops.common.interpret import INTERPRET
from megatron_iso.ops.common.tree_triton import fixed_tree_rowsum
from megatron_iso.ops.gemm.reference import check_dtype
from megatron_iso.ops.logprob.reference import (
    Comm,
    LocalShards,
    VocabScores,
    checked_valid_vocab,
    mask_padding,
    scale_logits,
    temperature_rows,
)
from megatron_iso.ops.logprob.slice_exp_triton import slice_exp
from megatron_iso.ops.logprob.temperature_triton import division_args, scale_by_temperature
from megatron_iso.registry import OpImpl, Profile, register

BLOCK = 1024  # lanes of a leaf's accumulator: part of the summation order (a contract constant)
# A schedule choice (the lane tree's order does not depend on it): one warp per program takes a slice's max with
# shuffles alone (no shared-memory step, no barrier), and more programs share an SM. On the H200 at 4096 x 151936
# (same bits at 1, 2 and 4 warps): bf16 t = 1 381 / 438 / 445 us, t = 0.7 679 / 664 / 694, fp32 566 / 577 / 611.
NUM_WARPS = 1
# A decode step's launch (a few rows: 8 programs a row, a small share of the GPU) is latency bound: each program walks
# 19 slices of 1024 logits one after another, and four warps take a slice in a quarter of the issue time. On the H200
# at a vocab of 151936, one row: 9.9 -> 8.3 us at t = 1, 27.7 -> 12.7 us at a tensor t = 0.7 (div_rn); 64 rows:
# 10.3 -> 11.4 and 28.0 -> 17.1 us (1 -> 4 warps, the same bits).
SMALL_LAUNCH_ROWS = 64
SMALL_LAUNCH_WARPS = 4


def leaf_kernel_warps(rows: int) -> int:
    """Warps per program of :func:`_leaf_kernel` for a launch over ``rows`` (rank-axis entries times rows)."""
    return SMALL_LAUNCH_WARPS if rows <= SMALL_LAUNCH_ROWS else NUM_WARPS


ROW_BLOCK = 64  # rows per program of the row kernels: a schedule choice (each row's numbers are its own)
# The steps of _row_stats_kernel: one shard holds the whole vocab (max, leaf sum and log in one launch); or,
# around the cross-rank collectives, a rank's leaf sum given the global max, then the log given the global sum.
STEP_WHOLE, STEP_RANK_SUM, STEP_LSE = 0, 1, 2


@triton.jit
def _leaf_kernel(
    x_ptr, t_ptr, recip, recip_lo, out_ptr, ROWS, SHARD, LEAF, VALID, FIRST_ID, stride_rank, stride_row,
    BLOCK: tl.constexpr, FAST_DIV: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    # out[r, row, leaf] = (m_l, s_l): the leaf's max of z and its sum of exp(z - m_l).
    pr = tl.program_id(0)  # rank-axis entry r and row, as r * ROWS + row
    leaf = tl.program_id(1)
    r = pr // ROWS
    row = pr - r * ROWS
    base = x_ptr + r.to(tl.int64) * stride_rank + row.to(tl.int64) * stride_row + leaf * LEAF
    first = FIRST_ID + r * SHARD + leaf * LEAF  # global vocab id of the leaf's first entry
    temp = tl.load(t_ptr + row)
    offs = tl.arange(0, BLOCK)[None, :]
    m = tl.full((1,), float("-inf"), tl.float32)
    acc = tl.zeros((1, BLOCK), tl.float32)
    # Slices wholly inside the leaf's real vocab ids run without masks (the selects below would be identities
    # there: the same bits); the rest (a partial slice, padding ids) take the masked loop.
    # Each slice is loaded one iteration ahead (into registers): the next read is in flight while this one's exps
    # run. Only the schedule of the loads changes, not an operation on a value.
    n_full = (tl.maximum(tl.minimum(LEAF, VALID - first), 0) // BLOCK) * BLOCK
    ahead = tl.load(base + offs, mask=offs < n_full, other=0.0)
    for start in range(0, n_full, BLOCK):
        x = ahead.to(tl.float32)
        # Unmasked (no zeroing of the registers first): the last slice re-reads itself, an L2 hit never used.
        ahead = tl.load(base + tl.minimum(start + BLOCK, n_full - BLOCK) + offs)
        z = scale_by_temperature(x, temp, recip, recip_lo, FAST_DIV)
        m_new = tl.maximum(m, tl.max(z, axis=1))  # a max: exact in any order
        scale = tl.where(m_new == m, 1.0, tl.exp(m - m_new))  # 1 exactly when unmoved (and while all -inf)
        # While every logit so far is -inf, z - m_new would be -inf - -inf (NaN): subtract 0 instead, so the slice
        # adds exp(-inf) = 0. One select per slice; a finite m_new is subtracted as it is.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        d_min = tl.min(z) - tl.max(m_sub)  # the least z - m_sub of the slice (subtraction is monotone)
        acc = tl.fma(acc, scale[:, None], slice_exp(z - m_sub[:, None], d_min, ASM))
        m = m_new
    for start in range(n_full, LEAF, BLOCK):
        idx = start + offs
        ok = (idx < LEAF) & (first + idx < VALID)
        x = tl.load(base + idx, mask=ok, other=1.0)  # 1, not 0: a masked lane must not make the slice divide
        z = scale_by_temperature(x.to(tl.float32), temp, recip, recip_lo, FAST_DIV)
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.where(m_new == m, 1.0, tl.exp(m - m_new))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = tl.fma(acc, scale[:, None], tl.where(ok, tl.exp(z - m_sub[:, None]), 0.0))
        m = m_new
    out = out_ptr + (pr * tl.num_programs(1) + leaf) * 2 + tl.arange(0, 1)
    tl.store(out, m)
    tl.store(out + 1, fixed_tree_rowsum(acc, 1, BLOCK))


def launch_leaf_kernel(
    x: torch.Tensor,
    temperature: torch.Tensor,
    per_leaf: torch.Tensor,
    valid_vocab: int,
    first_id: int,
    division: tuple[float, float, bool],
    *,
    asm: bool = not INTERPRET,
    num_warps: int | None = None,
) -> None:
    """:func:`_leaf_kernel` over ``x [R, rows, shard]`` (last dim contiguous) into ``per_leaf [R, rows, leaves, 2]``:
    ``temperature [rows]``, the vocab ids past ``valid_vocab`` masked, ``x``'s first id ``first_id``, and the
    division arguments of ``temperature_triton.division_args``. ``asm`` False: ``tl.exp`` in every slice
    (``slice_exp_triton``; the interpreter's form, and the GPU tests' reference for the same bits). ``num_warps``: a
    schedule choice (the lanes and their tree are the same at any count; the benchmark compares them), by default
    :func:`leaf_kernel_warps`."""
    R, rows, shard = x.shape
    leaves = per_leaf.shape[2]
    recip, recip_lo, fast = division
    num_warps = leaf_kernel_warps(R * rows) if num_warps is None else num_warps
    _leaf_kernel[(R * rows, leaves)](
        x, temperature, recip, recip_lo, per_leaf, rows, shard, shard // leaves, valid_vocab, first_id,
        x.stride(0), x.stride(1), BLOCK=BLOCK, FAST_DIV=fast, ASM=asm, num_warps=num_warps,
    )  # fmt: skip


@triton.jit
def _row_stats_kernel(
    per_leaf_ptr, m_ptr, s_ptr, lse_ptr, N, ROWS,
    LEAVES: tl.constexpr, STEP: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    # Entry n of the rank axis times the rows (r * ROWS + row); m, lse and the global s are per row.
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = n < N
    row = n % ROWS
    if STEP == 2:  # STEP_LSE
        m = tl.load(m_ptr + row, mask=ok, other=0.0)
        s = tl.load(s_ptr + row, mask=ok, other=1.0)
    else:
        at = per_leaf_ptr + (n[:, None] * LEAVES + tl.arange(0, LEAVES)[None, :]) * 2
        m_l = tl.load(at, mask=ok[:, None], other=0.0)
        if STEP == 0:  # STEP_WHOLE
            m = tl.max(m_l, axis=1)  # a max: exact
            tl.store(m_ptr + row, m, mask=ok)
        else:
            m = tl.load(m_ptr + row, mask=ok, other=0.0)
        w = tl.load(at + 1, mask=ok[:, None], other=1.0) * tl.exp(m_l - m[:, None])  # an all-padding leaf: 0
        s = tl.reshape(w, (BLOCK_R,)) if LEAVES == 1 else fixed_tree_rowsum(w, BLOCK_R, LEAVES)
    if STEP == 1:  # STEP_RANK_SUM
        tl.store(s_ptr + n, s, mask=ok)
    else:
        tl.store(lse_ptr + row, m + tl.log(s), mask=ok)


@triton.jit
def _token_logprob_kernel(
    x_ptr, stride_row, ids_ptr, t_ptr, lse_ptr, out_ptr, ROWS, SHARD, VALID, BLOCK_R: tl.constexpr
):
    # One shard holds the whole vocab: z_target - lse, z_target as VocabScores._z_at forms it (div_rn is the
    # IEEE division torch runs), a padding id at -inf.
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = row < ROWS
    ids = tl.load(ids_ptr + row, mask=ok, other=0)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + tl.minimum(tl.maximum(ids, 0), SHARD - 1), mask=ok)
    z = tl.math.div_rn(x.to(tl.float32), tl.load(t_ptr + row, mask=ok, other=1.0))
    z = tl.where(ids >= VALID, float("-inf"), z)
    tl.store(out_ptr + row, z - tl.load(lse_ptr + row, mask=ok, other=0.0), mask=ok)


class TritonScores(VocabScores):
    """:class:`~megatron_iso.ops.logprob.reference.VocabScores` with ``lse`` from :func:`_leaf_kernel`'s leaf sums;
    ``z`` (the fp32 scaled logits) is made only when a query needs every entry (``log_softmax``, ``entropy``).

    Forward only: the scoring API runs it under ``with_plain_backward`` (the native formula's gradient)."""

    def __init__(
        self,
        logits: torch.Tensor,
        comm: Comm,
        *,
        temperature: float | torch.Tensor = 1.0,
        leaves: int,
        valid_vocab: int | None = None,
    ) -> None:
        """``logits``: [R, ..., V/C], the R local vocab shards (shard r is global shard first_rank + r)."""
        check_dtype(logits, "logits")  # what scale_logits checks on the reference path
        if torch.is_grad_enabled() and logits.requires_grad:
            raise RuntimeError(
                "TritonScores is forward only: score through parallel.vocab_scoring (a plain backward) for gradients"
            )
        self._layout(logits, comm, leaves)
        shard = self.shard
        self.valid_vocab = checked_valid_vocab(valid_vocab, self.vocab)
        self.logits, self.temperature = logits, temperature
        self._z: torch.Tensor | None = None
        lead = tuple(logits.shape[1:-1])
        x = logits.reshape(logits.shape[0], -1, shard)
        if x.stride(-1) != 1 or x.stride(0) != x.shape[1] * shard:
            x = x.contiguous()
        R, rows = x.shape[0], x.shape[1]
        t = temperature_rows(temperature, lead, logits.device)
        self.row_temperature = t.reshape(lead)
        per_leaf = torch.empty((R, rows, self.local_leaves, 2), device=logits.device, dtype=torch.float32)
        if rows:
            division = division_args(temperature, logits.dtype, logits.device)
            launch_leaf_kernel(x, t, per_leaf, self.valid_vocab, comm.first_rank * shard, division)
        self._rows, self._row_t = x, t
        m, lse = self._row_statistics(per_leaf, comm)
        self.m, self.lse = m.reshape(lead), lse.reshape(lead)

    def _one_shard(self) -> bool:
        return self.logits.shape[0] == 1 and self.comm.world == 1

    def _row_statistics(self, per_leaf: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, lse)`` per row from the leaves' ``(m_l, s_l)`` ``[R, rows, L, 2]``."""
        R, rows, L = per_leaf.shape[:3]
        lse = torch.empty(rows, device=per_leaf.device, dtype=torch.float32)

        def launch(step: int, m: torch.Tensor, s: torch.Tensor, n: int) -> None:
            if n:
                grid = (triton.cdiv(n, ROW_BLOCK),)
                _row_stats_kernel[grid](
                    per_leaf, m, s, lse, n, rows, LEAVES=L, STEP=step, BLOCK_R=ROW_BLOCK, **NO_FMA
                )  # fmt: skip

        if self._one_shard():
            m = torch.empty_like(lse)
            launch(STEP_WHOLE, m, lse, rows)
            return m, lse
        m = comm.max(per_leaf[..., 0].amax(dim=-1)).contiguous()  # [rows]; every row has a valid entry: finite
        s_rank = torch.empty((R, rows), device=per_leaf.device, dtype=torch.float32)
        launch(STEP_RANK_SUM, m, s_rank, R * rows)
        launch(STEP_LSE, m, comm.tree(s_rank).contiguous(), rows)
        return m, lse

    def token_logprobs(self, target_ids: torch.Tensor, *, ids_in_range: bool = False) -> torch.Tensor:
        if not self._one_shard():
            return super().token_logprobs(target_ids, ids_in_range=ids_in_range)
        ids = self._checked_targets(target_ids, ids_in_range).reshape(-1)
        out = torch.empty_like(self.lse)
        rows = ids.numel()
        if rows:
            _token_logprob_kernel[(triton.cdiv(rows, ROW_BLOCK),)](
                self._rows, self._rows.stride(1), ids, self._row_t, self.lse, out, rows, self.shard,
                self.valid_vocab, BLOCK_R=ROW_BLOCK,
            )  # fmt: skip
        return out

    @property
    def z(self) -> torch.Tensor:
        if self._z is None:
            z = scale_logits(self.logits, self.temperature)
            self._z = mask_padding(z, self.comm.first_rank, self.vocab, self.valid_vocab)
        return self._z

    def _z_at(self, local: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """The picked logits scaled as ``z`` is (an elementwise IEEE division: the same bits), padding ids at -inf
        as in the masked ``z``: no fp32 copy of the whole vocab for a token logprob."""
        R = self.logits.shape[0]
        picked = self.logits.gather(-1, local.unsqueeze(0).expand(R, *local.shape).unsqueeze(-1)).squeeze(-1)
        return torch.where(target_ids >= self.valid_vocab, float("-inf"), picked.float() / self.row_temperature)


def _triton_scores(
    logits: torch.Tensor, comm: Comm, *, temperature: float | torch.Tensor, leaves: int, valid_vocab: int | None
) -> TritonScores:
    return TritonScores(logits, comm, temperature=temperature, leaves=leaves, valid_vocab=valid_vocab)


def _probe() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    logits, targets = (torch.randn(5, 4096, generator=g) * 3).cuda(), torch.randint(0, 4096, (5,), generator=g).cuda()
    out = {}
    for name, x in (("fp32", logits), ("bf16", logits.bfloat16())):
        for t in (1.0, 0.7):
            scores = TritonScores(x.unsqueeze(0), LocalShards(1), temperature=t, leaves=8)
            out[f"{name}.t{t}.logp"] = scores.token_logprobs(targets).cpu()
    return out


register(
    OpImpl(
        op="logprob",
        impl_id="vocab_logprob.triton",
        version="3",  # 3: -inf logits before any finite one add nothing (were NaN); 2: Triton row statistics
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=_triton_scores,
        constants={
            "accumulate": "fp32",
            "temperature": "fp32 div_rn",
            "max": "exact (running slice max per leaf, then max over leaves and ranks)",
            "exp_sum": f"per leaf: {BLOCK} lanes rescaled to the running max, fixed lane tree; "
            "leaves rescaled to the row max, leaf tree",
            "exp": "tl.exp (fp32), in the leaves and across them",
            "lse": "m + tl.log(s)",
            "fp_contraction": "leaf kernel: on; row statistics: off",
            "triton": triton.__version__,
        },
        probe=_probe,
    )
)


def token_logprobs_triton(
    shards: Sequence[torch.Tensor] | torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    leaves: int = 8,
    valid_vocab: int | None = None,
) -> torch.Tensor:
    """Single-process form (as ``reference.token_logprobs_shards``): ``shards`` are the C contiguous vocab shards
    ``[..., V/C]`` in rank order (one tensor: one shard)."""
    shards = [shards] if isinstance(shards, torch.Tensor) else list(shards)
    if not shards:
        raise ValueError("need at least one vocab shard")
    scores = TritonScores(
        shards[0].unsqueeze(0) if len(shards) == 1 else torch.stack(shards, dim=0),
        LocalShards(len(shards)),
        temperature=temperature,
        leaves=leaves,
        valid_vocab=valid_vocab,
    )
    return scores.token_logprobs(target_ids)


def vocab_parallel_check(logits: torch.Tensor, target_ids: torch.Tensor, temperature, leaves: int, world: int) -> bool:
    """True if ``world`` contiguous vocab shards give the same bits as one shard (TP invariance)."""
    one = token_logprobs_triton([logits], target_ids, temperature=temperature, leaves=leaves)
    many = token_logprobs_triton(list(logits.chunk(world, dim=-1)), target_ids, temperature=temperature, leaves=leaves)
    return bool(torch.equal(one.view(torch.int32), many.view(torch.int32)))
