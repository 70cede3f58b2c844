"""Grouped (MoE expert) leaf-tree GEMM: ``out[rows of e] = x[rows of e] @ weights[e].T`` for every expert.

Rows arrive sorted by expert (``counts[e]`` rows each, in expert order). Invariant kept: every row is the dense
leaf-tree GEMM's arithmetic with its own expert's weight, so its bits depend on the row and that weight only. Here:
the dispatch (:func:`grouped_linear`; cpu reference, its static form, cuda ``grouped_triton``, per-expert native),
and the deterministic backward, whose per-expert path reads the counts on the host once per forward
(:func:`counts_read_once`, :func:`counts_replayed` under activation recompute).

Design: docs/KERNELS.md, "Grouped expert GEMM".
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence

import torch

from megatron_iso.ops.common.dispatch import import_triton_module
from megatron_iso.ops.gemm.backend import GroupedLinear, Weights
from megatron_iso.ops.gemm.native import native_linear
from megatron_iso.ops.gemm.reference import (
    DEFAULT_LEAVES,
    check_dtype,
    leaf_tree_linear_forward,
    linear_backward,
    validate_leaves,
)
from megatron_iso.registry import OpImpl, Profile, register, register_per_device

OP = "grouped_gemm"
REFERENCE_ID, REFERENCE_VERSION = "grouped_leaf_tree_gemm.reference", "1"
NATIVE_ID, NATIVE_VERSION = "grouped_gemm.native", "1"
TRITON_MODULE = "megatron_iso.ops.gemm.grouped_triton"
BACKWARD_TRITON_MODULE = "megatron_iso.ops.gemm.grouped_backward_triton"
# Operand dtypes whose CUDA backward runs the grouped kernels; fp32 keeps the per-expert library loop (exact fp32).
BACKWARD_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def expert_weights(weights: Weights) -> list[torch.Tensor]:
    """The experts' ``[N, K]`` weights as a list (a ``[E, N, K]`` tensor is unbound, no copy), checked
    to share shape, dtype and device."""
    if isinstance(weights, torch.Tensor):
        if weights.dim() != 3:
            raise ValueError(f"grouped_gemm: stacked weights must be [E, N, K], got shape {tuple(weights.shape)}")
        ws = list(weights.unbind(0))
    else:
        ws = list(weights)
    if not ws:
        raise ValueError("grouped_gemm: weights is empty; need at least one expert")
    first = ws[0]
    for i, w in enumerate(ws):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"grouped_gemm: weights[{i}] must be a 2-D [N, K] tensor, got {type(w).__name__}")
        if w.shape != first.shape or w.dtype != first.dtype or w.device != first.device:
            raise ValueError(
                f"grouped_gemm: weights[{i}] is {tuple(w.shape)} {w.dtype} on {w.device}; every expert must match "
                f"weights[0] ({tuple(first.shape)} {first.dtype} on {first.device})"
            )
    return ws


def check_inputs(
    x: torch.Tensor, ws: list[torch.Tensor], counts: torch.Tensor, leaves: int, *, read_counts: bool = True
) -> tuple[int, int, int]:
    """Host-side checks shared by every path (no device sync). Returns ``(T, N, K)``. ``read_counts``:
    also check the values of host-resident counts (a static-shape caller reads none)."""
    check_dtype(x, "x")
    check_dtype(ws[0], "weights")
    if x.dim() != 2:
        raise ValueError(f"grouped_gemm: x must be [T, K] (rows sorted by expert), got shape {tuple(x.shape)}")
    n, k = ws[0].shape
    if x.shape[1] != k:
        raise ValueError(f"grouped_gemm: x has K={x.shape[1]} but the expert weights [N, K] have K={k}")
    if x.device != ws[0].device:
        raise ValueError(f"grouped_gemm: x is on {x.device} but the weights are on {ws[0].device}")
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.numel() != len(ws):
        shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"grouped_gemm: counts must be a 1-D tensor of {len(ws)} rows per expert, got {shape}")
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise TypeError(f"grouped_gemm: counts must be an integer tensor, got {counts.dtype}")
    validate_leaves(leaves, k=k)
    if read_counts and counts.device.type == "cpu":
        # Free to check here (no device sync); device-resident counts are checked asynchronously by the kernel path.
        if bool((counts < 0).any()):
            raise ValueError(f"grouped_gemm: counts has negative entries: {counts.tolist()}")
        if int(counts.sum()) != x.shape[0]:
            raise ValueError(f"grouped_gemm: counts sum to {int(counts.sum())} but x has T={x.shape[0]} rows")
    return x.shape[0], n, k


def grouped_by_expert(
    dense: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    x: torch.Tensor,
    weights: Weights,
    counts: torch.Tensor,
    leaves: int,
) -> torch.Tensor:
    """The readable definition: ``dense(x_e, w_e, leaves)`` on each expert's rows, fp32 ``[T, N]``.

    Reads the counts on the host (a device sync when they live on the GPU)."""
    ws = expert_weights(weights)
    t, n, _ = check_inputs(x, ws, counts, leaves)
    sizes = [int(c) for c in counts.tolist()]
    if any(c < 0 for c in sizes) or sum(sizes) != t:
        raise ValueError(f"grouped_gemm: counts {sizes} must be >= 0 and sum to x's T={t} rows")
    out = torch.empty((t, n), dtype=torch.float32, device=x.device)
    start = 0
    for w, c in zip(ws, sizes, strict=True):
        if c:
            out[start : start + c] = dense(x[start : start + c], w, leaves)
        start += c
    return out


def grouped_reference(x: torch.Tensor, weights: Weights, counts: torch.Tensor, leaves: int) -> torch.Tensor:
    """Per-expert torch reference leaf tree (``reference.leaf_tree_linear_forward``); any device."""
    return grouped_by_expert(leaf_tree_linear_forward, x, weights, counts, leaves)


def grouped_reference_static(x: torch.Tensor, weights: Weights, counts: torch.Tensor, leaves: int) -> torch.Tensor:
    """:func:`grouped_reference`'s bits with no host read of ``counts`` and work fixed by the shapes: every
    expert's leaf tree on all T rows, each row kept from its own expert (rows ``[start_e, end_e)`` from the
    prefix sum of the counts, on the counts' device). E times the work: for the CPU and tests, where the
    CUDA path's static grid has no equivalent. Counts summing to less than T leave the rest of the rows 0."""
    ws = expert_weights(weights)
    t, n, _ = check_inputs(x, ws, counts, leaves, read_counts=False)
    ends = torch.cumsum(counts.to(x.device), 0)
    starts = ends - counts.to(x.device)
    row = torch.arange(t, device=x.device).unsqueeze(1)
    out = torch.zeros((t, n), dtype=torch.float32, device=x.device)
    for e, w in enumerate(ws):
        mine = (row >= starts[e]) & (row < ends[e])
        out = torch.where(mine, leaf_tree_linear_forward(x, w, leaves), out)
    return out


def grouped_native(x: torch.Tensor, weights: Weights, counts: torch.Tensor, leaves: int | None = None) -> torch.Tensor:
    """Per-expert library GEMM in the weights' dtype, upcast to fp32 (what stock stacks compute)."""
    return grouped_by_expert(native_linear, x, weights, counts, DEFAULT_LEAVES if leaves is None else leaves)


class HostCounts:
    """The counts of a forward's grouped calls, copied to the host in one non-blocking copy at its end.

    ``add`` registers a call's counts under its call site (``site``: the first expert weight's ``id``; the fc1
    and fc2 calls of a layer pass the same tensor: one entry) and returns its place; ``close`` starts the copy of
    all of them; ``sizes`` gives one call's counts as ints, waiting for the copy first (a backward runs after the
    forward: the copy is done by then). ``keep_no_grad``: calls made without autograd (a checkpointed region's
    first run) are kept too, for the region's recomputation (:func:`counts_replayed`)."""

    def __init__(self, keep_no_grad: bool = False) -> None:
        self.keep_no_grad = keep_no_grad
        self.pending: list[torch.Tensor] = []
        self.sites: dict[int, int] = {}  # call site -> place in pending
        self.host: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None
        self.lists: list[list[int]] | None = None

    def add(self, counts: torch.Tensor, site: int) -> int | None:
        if self.host is not None:  # closed: a recomputation takes the site's first run; any other call reads its own
            return self.sites.get(site)
        if not self.pending or self.pending[-1] is not counts:
            self.pending.append(counts)
        self.sites[site] = len(self.pending) - 1
        return self.sites[site]

    def close(self) -> None:
        if self.host is not None or not self.pending:
            return
        flat = torch.cat([c.reshape(-1).to(torch.int64) for c in self.pending])
        # Pinned memory on CUDA, so the copy is asynchronous: it queues behind the forward, nothing waits for it.
        self.host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=flat.is_cuda)
        self.host.copy_(flat, non_blocking=True)
        if flat.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def sizes(self, index: int) -> list[int]:
        if self.lists is None:
            if self.done is not None:
                self.done.synchronize()
            flat = self.host.tolist()
            lengths = [c.numel() for c in self.pending]
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            self.lists = [flat[a : a + n] for a, n in zip(starts, lengths, strict=True)]
        return self.lists[index]


_HOST_COUNTS: contextvars.ContextVar[HostCounts | None] = contextvars.ContextVar("iso_grouped_counts", default=None)


@contextlib.contextmanager
def counts_read_once(*, keep_no_grad: bool = False) -> Iterator[HostCounts]:
    """Inside (a model forward): the backward of every grouped call made here takes its counts from one
    non-blocking device-to-host copy of all of them, started on exit, instead of a sync per call (docs/KERNELS.md,
    "Grouped expert GEMM"). The same counts, so the same bits. ``keep_no_grad`` (a training forward that activation
    recompute may rerun): calls without autograd are copied too, for :func:`counts_replayed`."""
    batch = HostCounts(keep_no_grad)
    token = _HOST_COUNTS.set(batch)
    try:
        yield batch
    finally:
        _HOST_COUNTS.reset(token)
        batch.close()


@contextlib.contextmanager
def counts_replayed(first: HostCounts) -> Iterator[None]:
    """Inside (a recomputation of part of the forward that ``first`` recorded, after it closed): each grouped call
    takes the counts its call site had in that forward from its copy, reading nothing itself; a call site the
    forward did not record reads its own in its backward."""
    token = _HOST_COUNTS.set(first)
    try:
        yield
    finally:
        _HOST_COUNTS.reset(token)


def device_backward(x: torch.Tensor, ws: Sequence[torch.Tensor]) -> bool:
    """Whether the backward runs the grouped Triton kernels (CUDA, 16-bit operands): they read the counts on the
    device, so the forward records none for the host."""
    return x.is_cuda and x.dtype in BACKWARD_KERNEL_DTYPES and ws[0].dtype == x.dtype


def per_expert_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    ws: Sequence[torch.Tensor],
    sizes: Sequence[int],
    *,
    need_x: bool = True,
    need_ws: Sequence[bool] | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """``(grad_x, [grad_w per expert])``: :func:`~megatron_iso.ops.gemm.reference.linear_backward` on each expert's
    rows (``sizes``: rows per expert, on the host), one library GEMM pair per expert."""
    grad_x = torch.empty_like(x) if need_x else None
    grad_ws: list[torch.Tensor | None] = []
    start = 0
    for i, (w, c) in enumerate(zip(ws, sizes, strict=True)):
        rows = slice(start, start + c)
        need_w = True if need_ws is None else need_ws[i]
        gx, gw = linear_backward(grad_out[rows], x[rows], w, need_x=need_x, need_w=need_w)
        if grad_x is not None:
            grad_x[rows] = gx
        grad_ws.append(gw)
        start += c
    return grad_x, grad_ws


class _GroupedLinear(torch.autograd.Function):
    """Invariant grouped forward; backward: the grouped kernels (:func:`device_backward`), else the dense op's matmul
    backward on each expert's rows."""

    @staticmethod
    def forward(ctx, x, counts, leaves, kernel, *ws):  # type: ignore[override]
        ctx.save_for_backward(x, counts, *ws)
        batch = None if device_backward(x, ws) else _HOST_COUNTS.get()
        index = None if batch is None else batch.add(counts, id(ws[0]))
        ctx.host_counts = None if index is None else (batch, index)
        return kernel(x, list(ws), counts, leaves)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, counts, *ws = ctx.saved_tensors
        if device_backward(x, ws):
            # Two launches over all experts, counts read on the device (grouped_backward_triton).
            mod = import_triton_module(BACKWARD_TRITON_MODULE, "the grouped GEMM backward on cuda")
            need_w = any(ctx.needs_input_grad[4:])
            grad_x, grad_w = mod.grouped_linear_backward_triton(
                grad_out, x, ws, counts, need_x=ctx.needs_input_grad[0], need_w=need_w
            )
            grad_ws = list(grad_w.unbind(0)) if need_w else [None] * len(ws)
            return (grad_x, None, None, None, *grad_ws)
        if ctx.host_counts is not None and ctx.host_counts[0].host is not None:
            batch, index = ctx.host_counts
            sizes = batch.sizes(index)  # the forward's one copy
        else:
            sizes = [int(c) for c in counts.tolist()]  # host sync: backward only
        grad_x, grad_ws = per_expert_backward(
            grad_out, x, ws, sizes, need_x=ctx.needs_input_grad[0], need_ws=ctx.needs_input_grad[4:]
        )
        return (grad_x, None, None, None, *grad_ws)


def _triton_forward(
    x: torch.Tensor, ws: list[torch.Tensor], counts: torch.Tensor, leaves: int, *, check_counts: bool = True
) -> torch.Tensor:
    mod = import_triton_module(TRITON_MODULE, "the grouped leaf-tree GEMM on cuda with profile=correctness")
    return mod.grouped_leaf_tree_linear_triton(x, ws, counts, leaves, check_counts=check_counts)


def grouped_linear(
    x: torch.Tensor,
    weights: Weights,
    counts: torch.Tensor,
    *,
    leaves: int = DEFAULT_LEAVES,
    profile: str = Profile.CORRECTNESS,
    static: bool = False,
    check_counts: bool = True,
) -> torch.Tensor:
    """fp32 ``[T, N]``: rows of ``x [T, K]`` (sorted by expert, ``counts[e]`` each) times their expert's
    ``[N, K]`` weight, by the implementation serving ``x``'s device class and ``profile``.
    Differentiable in ``x`` and the weights (a ``[E, N, K]`` tensor or a list of ``[N, K]``).
    ``static``: no host read of the counts in the forward (CUDA-graph capture), the same bits; correctness
    profile only (the per-expert library GEMMs of the performance profile split on the host). ``check_counts``
    False: the caller vouches for the counts (>= 0, summing to T: the column sums of a routing map it just built
    from k distinct experts per row), and the CUDA kernel launches no device assert (six small kernels)."""
    if profile == Profile.PERFORMANCE:
        if static:
            raise ValueError("grouped_gemm: static=True needs profile='correctness' (performance splits on the host)")
        return grouped_native(x, weights, counts, leaves)
    if profile != Profile.CORRECTNESS:
        raise ValueError(f"profile={profile!r}; expected 'correctness' or 'performance'")
    kernel: GroupedLinear
    if x.device.type == "cpu":
        kernel = grouped_reference_static if static else grouped_reference
    elif x.device.type == "cuda":
        kernel = _triton_forward if check_counts else functools.partial(_triton_forward, check_counts=False)
    else:
        raise ValueError(f"no correctness grouped GEMM for device type {x.device.type!r}")
    ws = expert_weights(weights)
    check_inputs(x, ws, counts, leaves, read_counts=not static)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws)):
        return _GroupedLinear.apply(x, counts, leaves, kernel, *ws)
    kept = None if device_backward(x, ws) else _HOST_COUNTS.get()
    if kept is not None and kept.keep_no_grad:  # a checkpointed region's first run: its recomputation takes these
        kept.add(counts, id(ws[0]))
    return kernel(x, ws, counts, leaves)


def _probe_inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(9, 64, generator=g)
    w = torch.randn(4, 24, 64, generator=g) / 8
    counts = torch.tensor([3, 0, 1, 5])  # an empty expert and a one-row expert
    return x.to(device), w.to(device), counts.to(device)


def _probe_reference() -> dict[str, torch.Tensor]:
    x, w, c = _probe_inputs("cpu")
    return {
        "fp32": grouped_reference(x, w, c, DEFAULT_LEAVES),
        "bf16": grouped_reference(x.bfloat16(), w.bfloat16(), c, DEFAULT_LEAVES),
    }


def _probe_native(device: str):
    def probe() -> dict[str, torch.Tensor]:
        x, w, c = _probe_inputs(device)
        return {"fp32": grouped_native(x, w, c), "bf16": grouped_native(x.bfloat16(), w.bfloat16(), c)}

    return probe


register(
    OpImpl(
        op=OP,
        impl_id=REFERENCE_ID,
        version=REFERENCE_VERSION,
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=grouped_reference,
        constants={
            "per_expert": "leaf_tree_gemm.reference on each expert's contiguous rows",
            "accumulate": "fp32",
            "row_order": "sorted by expert, counts per expert",
        },
        probe=_probe_reference,
    )
)
register_per_device(
    op=OP,
    impl_id=NATIVE_ID,
    version=NATIVE_VERSION,
    profile=Profile.PERFORMANCE,
    fn=grouped_native,
    constants={"algorithm": "library_matmul per expert", "accumulate": "library"},
    probe_for=_probe_native,
)

__all__ = [
    "OP",
    "HostCounts",
    "counts_read_once",
    "counts_replayed",
    "expert_weights",
    "grouped_by_expert",
    "grouped_linear",
    "grouped_native",
    "grouped_reference",
    "grouped_reference_static",
    "per_expert_backward",
]
