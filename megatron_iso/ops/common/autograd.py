"""Training through invariant kernels: the invariant forward, a plain deterministic backward.

The invariant implementations are forward-only in spirit: some write state in place (attention's
online softmax), others compute in fp64 through long elementwise chains (the CPU references of
silu, RMSNorm), which autograd would have to store for the backward. The policy asks only that
backward be deterministic, not invariant, so :func:`with_plain_backward` runs the invariant
function without a graph and, in the backward, recomputes the op with its plain differentiable
formula (the native implementation) and differentiates that. The forward's bits are unchanged.
Where the plain form's autograd is many elementwise passes (the norms, SwiGLU), a GPU backward kernel
that computes the same gradients in one pass replaces it: :func:`with_fused_backward`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def plain_grads(
    plain: Callable[..., torch.Tensor], args: Sequence[Any], needs_grad: Sequence[bool], grad_out: torch.Tensor
) -> list[torch.Tensor | None]:
    """The plain backward: gradients of ``plain(*args)`` against ``grad_out``, one per argument.

    Recomputes ``plain`` with autograd on detached copies of the floating tensors whose ``needs_grad`` is
    set (None for every other argument); each gradient comes back in its argument's dtype.
    """
    args = list(args)
    leaves = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point() and needs_grad[i]]
    for i in leaves:
        args[i] = args[i].detach().requires_grad_(True)
    grads: list[torch.Tensor | None] = [None] * len(args)
    if leaves:
        with torch.enable_grad():
            out = plain(*args)
            found = torch.autograd.grad(out, [args[i] for i in leaves], grad_out.to(out.dtype), allow_unused=True)
        for i, g in zip(leaves, found, strict=True):
            grads[i] = None if g is None else g.to(args[i].dtype)
    return grads


class _InvariantForward(torch.autograd.Function):
    """``invariant(*args)`` without a graph; its backward is ``grads(grad_out, args, needs_grad)``: one gradient
    per argument (None where not needed)."""

    @staticmethod
    def forward(ctx, invariant, grads, *args):  # type: ignore[override]
        ctx.grads = grads
        ctx.tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_pos))
        with torch.no_grad():
            return invariant(*args)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_pos, ctx.saved_tensors, strict=True):
            args[i] = t
        return (None, None, *ctx.grads(grad_out, args, ctx.needs_input_grad[2:]))


def _apply(invariant: Callable[..., torch.Tensor], grads: Callable[..., Sequence[Any]], args: Sequence[Any]):
    needs_grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if not needs_grad:
        return invariant(*args)
    return _InvariantForward.apply(invariant, grads, *args)


def with_plain_backward(
    invariant: Callable[..., torch.Tensor], plain: Callable[..., torch.Tensor], *args: Any
) -> torch.Tensor:
    """``invariant(*args)``; when a gradient is needed, backward differentiates ``plain(*args)``.

    Positional arguments only (bind keywords with functools.partial); one tensor output.
    """
    return _apply(invariant, lambda grad_out, saved, needs: plain_grads(plain, saved, needs, grad_out), args)


def with_fused_backward(
    invariant: Callable[..., torch.Tensor], backward: Callable[..., Sequence[torch.Tensor | None]], *args: Any
) -> torch.Tensor:
    """``invariant(*args)``; when a gradient is needed, ``backward(grad_out, *args)`` returns one gradient per
    argument (None for non-tensors). ``backward`` must be deterministic; it need not be invariant."""

    def grads(grad_out: torch.Tensor, saved: Sequence[Any], needs: Sequence[bool]) -> list[torch.Tensor | None]:
        found = backward(grad_out.contiguous(), *saved)
        return [g if need else None for g, need in zip(found, needs, strict=True)]

    return _apply(invariant, grads, args)
