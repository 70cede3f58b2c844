"""Tree collectives: the transport only moves fp32 partials; the sum is always ``ops.common.tree``.

A collective library's all-reduce adds in an order of its own choosing (ring, tree, chunked,
whatever rank answered first), so TP=2 and TP=4 would add the same leaves differently. Here
every rank receives the partials of all ranks and adds them with ``tree_sum`` in rank order.
Rank i's partial is the node of the global leaf tree over its leaves, so finishing the tree in
rank order gives the TP=1 expression bit for bit.

Two forms share the same ``tree_sum``:
- distributed: ``tree_all_reduce`` / ``tree_reduce_scatter`` over a process group;
- single process: ``tree_combine`` over a list of per-rank partials (ranks simulated in one process, e.g.
  TP=8 on a laptop).

Autograd follows Megatron's conventions (all-reduce: identity backward; reduce-scatter: all-gather
backward). Backward gradients that need a sum use the tree too, so they are deterministic.
Native counterparts (library sums) serve the performance profile and the mismatch baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_iso.ops.common.tree import tree_sum
from megatron_iso.registry import Profile, register_per_device

Group = dist.ProcessGroup | None


def _size(group: Group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _rank(group: Group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def all_gather_list(t: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), in rank order. Pure transport."""
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(_size(group))]
    dist.all_gather(out, t, group=group)
    return out


# ---------------------------------------------------------------- single-process (simulated ranks)


def tree_combine(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Finish the tree over per-rank partials listed in rank order (what every rank would get)."""
    return tree_sum(list(partials))


# ---------------------------------------------------------------- distributed


def _tree_all_reduce_fwd(t: torch.Tensor, group: Group) -> torch.Tensor:
    return tree_sum(all_gather_list(t, group))


def _tree_reduce_scatter_fwd(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    c = _size(group)
    if t.shape[dim] % c:
        raise ValueError(f"reduce-scatter: dim {dim} of size {t.shape[dim]} is not divisible by world size {c}")
    # all_to_all: rank j sends its block i to rank i, so rank i holds every rank's block i and sums
    # only that block (1/C of the adds of all-gather + slice, same bits).
    blocks = t.movedim(dim, 0).contiguous()
    recv = torch.empty_like(blocks)
    dist.all_to_all_single(recv, blocks, group=group)
    parts = recv.chunk(c, dim=0)
    return tree_sum(list(parts)).movedim(0, dim).contiguous()


def _all_gather_cat(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return torch.cat(all_gather_list(t, group), dim=dim)


def _in_fp32(fn, t: torch.Tensor, *args) -> torch.Tensor:
    # Backward grads may arrive in bf16; add them in fp32 with the tree, round once.
    return fn(t.float(), *args).to(t.dtype)


class _TreeAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):  # type: ignore[override]
        return _tree_all_reduce_fwd(t, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # Output is replicated on every rank (Megatron convention): each rank's gradient is already
        # the full gradient of its own partial.
        return grad, None


class _TreeReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group, dim):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _tree_reduce_scatter_fwd(t, group, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather_cat(grad, ctx.group, ctx.dim), None, None


def tree_all_reduce(partial: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum of every rank's ``partial`` (fp32 for GEMM partials) with the tree in rank order."""
    if _size(group) == 1:
        return partial
    return _TreeAllReduce.apply(partial, group)


def tree_reduce_scatter(partial: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    """This rank's block (along ``dim``, blocks in rank order) of ``tree_all_reduce(partial)``."""
    if _size(group) == 1:
        return partial
    return _TreeReduceScatter.apply(partial, group, dim)


# ---------------------------------------------------------------- transport with autograd (no arithmetic forward)


class _CopyToTP(torch.autograd.Function):
    """Forward identity; backward sums the input grads of all ranks with the tree."""

    @staticmethod
    def forward(ctx, t, group):  # type: ignore[override]
        ctx.group = group
        return t

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _in_fp32(_tree_all_reduce_fwd, grad, ctx.group), None


class _GatherAlong(torch.autograd.Function):
    """Forward all-gather along ``dim``; backward: ``tree`` reduce-scatter (SP) or own block."""

    @staticmethod
    def forward(ctx, t, group, dim, reduce_grad):  # type: ignore[override]
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _all_gather_cat(t, group, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.reduce_grad:
            return _in_fp32(_tree_reduce_scatter_fwd, grad, ctx.group, ctx.dim), None, None, None
        return grad.chunk(_size(ctx.group), dim=ctx.dim)[_rank(ctx.group)].contiguous(), None, None, None


class _SplitAlong(torch.autograd.Function):
    """Forward: own block along ``dim``; backward: all-gather of the grads."""

    @staticmethod
    def forward(ctx, t, group, dim):  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return t.chunk(_size(group), dim=dim)[_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather_cat(grad, ctx.group, ctx.dim), None, None


def copy_to_tp(t: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Enter a column-parallel region: identity forward, tree all-reduce of grads backward."""
    return t if _size(group) == 1 else _CopyToTP.apply(t, group)


def gather_rows(t: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    """Sequence-parallel all-gather of rows (transport); backward = tree reduce-scatter."""
    return t if _size(group) == 1 else _GatherAlong.apply(t, group, dim, True)


def gather_along(t: torch.Tensor, group: Group = None, dim: int = -1) -> torch.Tensor:
    """All-gather of a replicated-convention output (e.g. column shards); backward = own block."""
    return t if _size(group) == 1 else _GatherAlong.apply(t, group, dim, False)


def split_along(t: torch.Tensor, group: Group = None, dim: int = -1) -> torch.Tensor:
    """This rank's block along ``dim``; backward = all-gather of the grads."""
    return t if _size(group) == 1 else _SplitAlong.apply(t, group, dim)


# ---------------------------------------------------------------- native counterparts


def native_all_reduce(t: torch.Tensor, group: Group = None) -> torch.Tensor:
    """The library's SUM all-reduce (order chosen by the backend). Performance profile/baseline."""
    if _size(group) == 1:
        return t
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _probe_tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(4, 16, generator=g) for _ in range(8)]
    return {
        "combine8": tree_combine(parts),
        "combine2": tree_combine([tree_combine(parts[:4]), tree_combine(parts[4:])]),
    }


register_per_device(
    op="tp_reduce",
    impl_id="tree_all_reduce",
    version="1",
    profile=Profile.CORRECTNESS,
    fn=tree_all_reduce,
    constants={"transport": "all_gather", "combine": "balanced_tree_rank_order", "dtype": "fp32"},
    probe_for=lambda device: _probe_tree,  # one CPU probe serves both device classes
)
register_per_device(
    op="tp_reduce",
    impl_id="native_all_reduce",
    version="1",
    profile=Profile.PERFORMANCE,
    fn=native_all_reduce,
    constants={"combine": "backend_sum"},
)
