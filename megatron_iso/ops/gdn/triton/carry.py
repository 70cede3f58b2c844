"""The gated delta rule with a carried state (``ops.gdn.gated_delta_rule_carry`` on the GPU kernels): sequences that
each begin on one of their own chunk boundaries, entering with a given fp32 state, returning ``(out, exit)``, exit the
state at each sequence's last chunk boundary; differentiable in the entry state too. Context parallelism cuts a
sequence at a chunk boundary and carries the state rank to rank through it (``models.gdn_context``).

The forward is the rule's own kernels on a carried plan (``plan._plan(carry=True)``): the chain starts each sequence
from its entry row instead of zeros (entry kind 1, as a prefill from a state cache starts from the cached entry) and
writes the state at its last chunk boundary back to that row (a clone of the entry: the exit, as a prefill writes the
cache's entry); the scan form's first segment starts from the same row. No kernel changes: a chunk boundary's state
is the same fp32 value whether the chain holds it in registers (one uncut call) or reads it from the entry tensor (the
call after a cut), so every row of the cut calls has the uncut call's bits, in either output form and at any dot
precision. The backward is :func:`.backward.rule_backward` with ``carry``: the chain starts from the exit's gradient
and ends with the entry's (docs/GDN.md, "Carried state").
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_iso.ops.gdn.checks import check_entry, check_rule_args
from megatron_iso.ops.gdn.reference import DEFAULT_CHUNK
from megatron_iso.ops.gdn.triton import tuning
from megatron_iso.ops.gdn.triton.backward import rule_backward
from megatron_iso.ops.gdn.triton.chunk_out import chunk_outputs
from megatron_iso.ops.gdn.triton.plan import cached_plan
from megatron_iso.ops.gdn.triton.rule import _rows
from megatron_iso.ops.gdn.triton.scan import scan_outputs
from megatron_iso.ops.gdn.triton.state_pass import no_state, state_pass, state_rows
from megatron_iso.ops.gdn.triton.tuning import GDNConfig, config_for, form_dot_precision


def _carried_state_pass(plan, prep_rows, entry: torch.Tensor, ex: torch.Tensor, cfg: GDNConfig, wy: bool):
    """The state pass of a carried plan from ``entry`` (fp32 ``[n, Hv, Dk, Dv]``, not written): its terms and the
    exit states (the chain's write-back, into a clone of ``entry``)."""
    exit_ = entry.clone()
    # the chunk form's chain also writes the exit rounded to bf16 (a state cache's entry_bf16): a scratch here
    bf16 = torch.empty(exit_.shape if cfg.form == "chunk" else (1,), dtype=torch.bfloat16, device=entry.device)
    unused = no_state(ex)  # no buffered token, no buffer row: never read or written
    terms = state_pass(plan, prep_rows, (unused,) * 4, (exit_, bf16), ex, cfg, None, wy=wy)
    return terms, exit_


def _carry_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    entry: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    chunk: int,
    dot_precision: str | None,
    form: str | None,
    kept: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, exit)``; ``kept``: a training call's dict for the backward (``cfg``, ``scale``; chunk form: ``plan``
    and ``states``, as ``rule._rule_forward`` keeps them)."""
    check_rule_args(q, k, v, g, beta, chunk, None)
    t, _, dk = k.shape
    hv, dv = v.shape[1:]
    form = form or tuning.FORM
    cfg = config_for(dk, dv, chunk, form_dot_precision(form, dot_precision), form)
    scale = dk**-0.5 if scale is None else float(scale)
    dev = q.device
    plan = cached_plan(cu_seqlens, None, None, chunk, False, dev, 0, cfg.form, carry=True)
    check_entry(entry, plan.n, hv, dk, dv)
    if entry.device != dev:
        raise ValueError(f"gated_delta_rule_carry: entry is on {entry.device}, the inputs on {dev}")
    entry = entry.detach().contiguous()
    if kept is not None:
        kept.update(cfg=cfg, scale=scale)
    (qf, sq), *prep_rows = (_rows(x) for x in (q, k, v, g, beta))
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=dev)
    ex = state_rows(plan.nchunks, hv, dk, dv, cfg, dev)
    terms, exit_ = _carried_state_pass(plan, tuple(prep_rows), entry, ex, cfg, wy=kept is not None)
    u, gcum = terms[0], terms[4]
    if cfg.form == "chunk":
        if kept is not None:
            kept.update(plan=plan, states=(*terms, ex))
        chunk_outputs((qf, sq), prep_rows[0], no_state(ex), plan, ex, u, gcum, out, cfg, scale)
    else:  # each sequence's first segment starts from its entry row (the plan's scan start kind 1)
        unused = no_state(ex)
        scan_outputs((qf, sq), tuple(prep_rows), (unused,) * 4, out, plan, entry, ex, unused, cfg, scale)
    return out, exit_


def gated_delta_rule_carry(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    entry: torch.Tensor,
    *,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    dot_precision: str | None = None,
    form: str | None = None,
    keep_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over sequences that each begin on one of their own chunk boundaries, entering with ``entry [n, Hv,
    Dk, Dv]`` (fp32): ``(out [T, Hv, Dv], exit [n, Hv, Dk, Dv])``, the semantics and shapes of
    ``reference.gated_delta_rule_carry`` with the bits of :func:`.rule.gated_delta_rule` over the uncut sequences
    (same ``form`` and ``dot_precision``). Differentiable in q, k, v, g, beta and ``entry``; ``keep_states`` as the
    rule's."""
    fwd = functools.partial(
        _carry_forward, cu_seqlens=cu_seqlens, scale=scale, chunk=chunk, dot_precision=dot_precision, form=form
    )
    inputs = (q, k, v, g, beta, entry)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        return fwd(*inputs)
    return _CarryFunction.apply(*inputs, fwd, cu_seqlens, keep_states)


class _CarryFunction(torch.autograd.Function):
    """A carried training call: the forward above; backward, the Triton chunk backward from the exit's gradient to
    the entry's, over the chunk-form state pass the chunk form kept or recomputed (as ``rule._RuleFunction``)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, entry, fwd, cu_seqlens, keep_states):  # type: ignore[override]
        kept: dict = {}
        out, exit_ = fwd(q, k, v, g, beta, entry, kept=kept)
        ctx.cfg, ctx.scale, ctx.plan, ctx.cu = kept["cfg"], kept["scale"], kept.get("plan"), cu_seqlens
        ctx.save_for_backward(q, k, v, g, beta, entry, *(kept.get("states", ()) if keep_states else ()))
        return out, exit_

    @staticmethod
    def backward(ctx, d_out, d_exit):  # type: ignore[override]
        q, k, v, g, beta, entry, *states = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        hk, dk = k.shape[1:]
        hv, dv = v.shape[1:]
        rows = tuple(_rows(x) for x in inputs)
        cfg, plan = ctx.cfg, ctx.plan
        entry = entry.detach().contiguous()
        if not states:  # scan-form forward (or states not kept): the chunk-form carried state pass of the same chunks
            cfg = dataclasses.replace(cfg, form="chunk")
            plan = cached_plan(ctx.cu, None, None, cfg.chunk, False, q.device, 0, "chunk", carry=True)
            ex = state_rows(plan.nchunks, hv, dk, dv, cfg, q.device)
            states = (*_carried_state_pass(plan, rows[1:], entry, ex, cfg, wy=True)[0], ex)
        d_entry = torch.empty_like(entry)
        d_exit = torch.zeros_like(entry) if d_exit is None else d_exit.float().contiguous()
        grads = rule_backward(d_out, rows, (hk, dk, hv, dv), plan, tuple(states), cfg, ctx.scale, (d_exit, d_entry))
        return (*(d.to(x.dtype) for d, x in zip(grads, inputs, strict=True)), d_entry, None, None, None)
