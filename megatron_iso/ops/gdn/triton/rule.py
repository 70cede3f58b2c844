"""The gated delta rule's forward driver (checks, plan, state pass, outputs or a decode step), its autograd Function
with the Triton chunk backward, and the registration of the package's cuda/correctness implementations with the
op registry (importing this module registers them; the package imports it)."""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from megatron_iso.ops.gdn.checks import check_rule_args, check_state_slots
from megatron_iso.ops.gdn.reference import DEFAULT_CHUNK, L2NORM_EPS
from megatron_iso.ops.gdn.state_cache import GDNLayerState, check_value_buffer
from megatron_iso.ops.gdn.triton import tuning
from megatron_iso.ops.gdn.triton.backward import rule_backward
from megatron_iso.ops.gdn.triton.chunk_out import buffer_open_chunks, chunk_outputs
from megatron_iso.ops.gdn.triton.conv_gates import causal_conv1d, gdn_gates, l2norm
from megatron_iso.ops.gdn.triton.decode import decode_step
from megatron_iso.ops.gdn.triton.plan import cached_plan, decode_plan
from megatron_iso.ops.gdn.triton.scan import scan_outputs
from megatron_iso.ops.gdn.triton.state_pass import no_entries, no_state, state_pass, state_rows
from megatron_iso.ops.gdn.triton.tuning import GDNConfig, config_for, form_dot_precision
from megatron_iso.registry import OpImpl, Profile, register

# The implementation version the contract registers for each op below (OpImpl.version): it names the kernels' bits,
# so a change that moves a bit of any output bumps it.
VERSION = "8"


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # read in-kernel, widened exactly to fp32
# The state cache's tensors the kernels read and write in place with one fixed dtype (buf_v and buf_u may be narrower:
# _check_state_dtypes)
_STATE_DTYPES = {
    **dict.fromkeys(("buf_k", "buf_g", "buf_beta", "buf_tinv"), torch.float32),
    "entry_bf16": torch.bfloat16,
}


def _check_state_dtypes(state: GDNLayerState, v_dtype: torch.dtype, cfg: GDNConfig) -> None:
    """Each state tensor contiguous and in a dtype the kernels read and write without moving a bit: the fixed ones,
    ``buf_v`` in fp32 or v's dtype, ``buf_u`` in fp32 or the dtype the chunk form stores u in (``cfg.mid_dtype``)."""
    for name in (*_STATE_DTYPES, "buf_v", "buf_u", "buf_y"):
        buf, dtype = getattr(state, name), _STATE_DTYPES.get(name)
        if not buf.is_contiguous() or dtype not in (None, buf.dtype):
            raise ValueError(f"gated_delta_rule: state.{name} must be contiguous" + (f" {dtype}" if dtype else ""))
    check_value_buffer(state, v_dtype, "gated_delta_rule")
    for name in ("buf_u", "buf_y"):
        if getattr(state, name).dtype not in (torch.float32, cfg.mid_dtype):
            raise ValueError(
                f"gated_delta_rule: state.{name} is {getattr(state, name).dtype}, but dot_precision="
                f"{cfg.dot_precision!r} stores u and Y as {cfg.mid_dtype}; allocate the GDN state with "
                "u_dtype=chunk_u_dtype(dot_precision) or torch.float32"
            )


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` as a kernel reads it, and its row stride: as it is when its dtype widens exactly to fp32 and its
    dims after the first are contiguous (a view of the model's split q/k/v projection is), else an fp32
    contiguous copy. Saves the host-side cast/copy launch of a decode step."""
    inner = x.shape[1:]
    want, step = [], 1
    for n in reversed(inner):
        want.append(step)
        step *= n
    ok = all(n == 1 or st == w for n, st, w in zip(inner, x.stride()[1:], reversed(want), strict=True))
    if x.dtype not in _KERNEL_DTYPES or not ok:
        x = x.float().contiguous()
    return x, x.stride(0)


def _rule_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None,
    chunk: int,
    state: GDNLayerState | None,
    slots: torch.Tensor | None,
    starts: torch.Tensor | None,
    dot_precision: str | None,
    form: str | None,
    kept: dict | None = None,
) -> torch.Tensor:
    """The forward (docs/GDN.md, "GPU kernels"). ``kept``: a training call's dict for the backward: ``cfg``, ``scale`` and,
    for the chunk form, ``plan`` and ``states`` (the chunk-form state pass, :mod:`.backward`)."""
    check_rule_args(q, k, v, g, beta, chunk, state)
    t, _, dk = k.shape
    hv, dv = v.shape[1:]
    form = form or tuning.FORM
    dot_precision = form_dot_precision(form, dot_precision)
    cfg = config_for(dk, dv, chunk, dot_precision, form)
    scale = dk**-0.5 if scale is None else float(scale)
    dev = q.device
    slot_count = 0 if state is None else state.entry.shape[0]
    chunk_form = cfg.form == "chunk"
    # One token per sequence with a state cache: a chunk-form decode step, planned on the device (graph-safe)
    decoding = chunk_form and state is not None and cu_seqlens.numel() - 1 == t > 0
    if decoding:
        check_state_slots(True, slots, t)
        plan = decode_plan(cu_seqlens, starts, slots, chunk, dev, slot_count)
    else:
        plan = cached_plan(cu_seqlens, starts, slots, chunk, state is not None, dev, slot_count, cfg.form)
    if kept is not None:
        kept.update(cfg=cfg, scale=scale)
    (qf, sq), (kf, sk), (vf, sv), (gf, sg), (bf, sb) = (_rows(x) for x in (q, k, v, g, beta))
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=dev)
    if t == 0:
        return out
    ex = state_rows(plan.nchunks, hv, dk, dv, cfg, dev)
    if state is not None:
        bk, bvv, bg, bb = state.buf_k, state.buf_v, state.buf_g, state.buf_beta
        _check_state_dtypes(state, v.dtype, cfg)
        needs = (
            {
                "buf_u": (chunk, hv, dv),
                "buf_y": (chunk, hv, dv),
                "buf_tinv": (hv, chunk, chunk),
                "entry_bf16": (hv, dk, dv),
            }
            if chunk_form
            else {"running": (hv, dk, dv)}
        )
        for name, shape in needs.items():
            if tuple(getattr(state, name).shape[1:]) != shape:
                raise ValueError(
                    f"gated_delta_rule: form={cfg.form!r} reads state.{name}, but this state cache was allocated for "
                    f"the other form (GDNLayerState.allocate(..., form={cfg.form!r}); profile.gdn_form)"
                )
        entries, running = (state.entry, state.entry_bf16), state.running
    else:
        bk = bvv = bg = bb = running = no_state(ex)
        entries = no_entries(ex)
    prep_rows = ((kf, sk), (vf, sv), (gf, sg), (bf, sb))
    if decoding:  # row by row
        decode_step((qf, sq), prep_rows, (bk, bvv, bg, bb), state, plan, entries, out, cfg, scale)
        return out
    buf_y = state.buf_y if state is not None and chunk_form else None
    terms = state_pass(plan, prep_rows, (bk, bvv, bg, bb), entries, ex, cfg, buf_y, wy=kept is not None)
    u, gcum = terms[0], terms[4]
    if kept is not None and chunk_form:
        kept.update(plan=plan, states=(*terms, ex))
    if chunk_form:  # output tiles per chunk from its entry state (ex) and u; then the buffer
        chunk_outputs((qf, sq), (kf, sk), bk, plan, ex, u, gcum, out, cfg, scale)
        if plan.buffers:
            buffer_open_chunks(prep_rows, (bk, bvv, bg, bb), plan, u, terms[5], state, cfg)
        return out
    fin = running
    if state is not None and plan.scratch:
        fin = torch.empty(plan.n, hv, dk, dv, dtype=torch.float32, device=dev)
    # The scan also writes the tokens of chunks this call leaves open into the state's buffer (seg column 7).
    # Ordering: it runs after the prep kernel, so a chunk closed from the buffer has been read before the
    # buffer rows are reused (a sequence whose call closes a chunk restarts its buffer at row 0).
    scan_outputs((qf, sq), prep_rows, (bk, bvv, bg, bb), out, plan, running, ex, fin, cfg, scale)
    if state is not None and plan.scratch:
        running.index_copy_(0, slots.to(device=dev, dtype=torch.int64), fin)
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    state: GDNLayerState | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    dot_precision: str | None = None,
    form: str | None = None,
    keep_states: bool = True,
) -> torch.Tensor:
    """CPR gated delta rule over packed sequences (fp32 ``[T, Hv, Dv]``); see docs/GDN.md, "GPU kernels".

    ``dot_precision``: ``input_precision`` of the state pass's dots, one of :data:`DOT_PRECISIONS` for both
    kernels or ``"PREP/CHAIN"`` (None: :data:`DOT_PRECISION`, the registered one; for the chunk form
    :data:`CHUNK_DOT_PRECISION`, and only :data:`CHUNK_FORM_PRECISIONS`). Training and rollout must pass
    the same value: it fixes the state pass's bits (the state cache does not record it).
    ``form``: how outputs are computed, one of :data:`FORMS` (None: :data:`FORM`, the registered one); the same
    rule holds: training and rollout pass the same form (a state cache filled under one is meaningless to the other).
    ``keep_states``: with a gradient, a chunk-form forward keeps its state pass for the backward (False: the backward
    recomputes it; the same kernels on the same inputs, so the same gradient bits; ``ops.gdn.BACKWARD_STATES``)."""
    fwd = functools.partial(
        _rule_forward, cu_seqlens=cu_seqlens, scale=scale, chunk=chunk, state=state, slots=slots, starts=starts,
        dot_precision=dot_precision, form=form,
    )  # fmt: skip
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta))
    if not needs_grad:
        return fwd(q, k, v, g, beta)
    if state is not None:
        raise NotImplementedError(
            "gated_delta_rule (triton): gradients through a call with a GDN state cache (rollout) are not supported"
        )
    return _RuleFunction.apply(q, k, v, g, beta, fwd, cu_seqlens, keep_states)


class _RuleFunction(torch.autograd.Function):
    """The invariant forward of a training call; backward: the Triton chunk backward (:mod:`.backward`),
    from the chunk-form state pass a chunk-form forward kept, or recomputed after a scan-form one (same chunks, same
    algebra: the backward only has to be deterministic)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, fwd, cu_seqlens, keep_states):  # type: ignore[override]
        kept: dict = {}
        out = fwd(q, k, v, g, beta, kept=kept)
        ctx.cfg, ctx.scale, ctx.plan, ctx.cu = kept.get("cfg"), kept.get("scale"), kept.get("plan"), cu_seqlens
        ctx.save_for_backward(q, k, v, g, beta, *(kept.get("states", ()) if keep_states else ()))
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        q, k, v, g, beta, *states = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        if q.shape[0] == 0:
            return (*(torch.zeros_like(x) for x in inputs), None, None, None)
        hk, dk = k.shape[1:]
        hv, dv = v.shape[1:]
        rows = tuple(_rows(x) for x in inputs)
        cfg, plan = ctx.cfg, ctx.plan
        if not states:  # scan-form forward (or states not kept): the chunk-form state pass of the same chunks
            cfg = dataclasses.replace(cfg, form="chunk")
            plan = cached_plan(ctx.cu, None, None, cfg.chunk, False, q.device, 0, "chunk")
            ex = state_rows(plan.nchunks, hv, dk, dv, cfg, q.device)
            unused = no_state(ex)
            states = (*state_pass(plan, rows[1:], (unused,) * 4, no_entries(ex), ex, cfg), ex)
        grads = rule_backward(d_out, rows, (hk, dk, hv, dv), plan, tuple(states), cfg, ctx.scale)
        return (*(d.to(x.dtype) for d, x in zip(grads, inputs, strict=True)), None, None, None)


def _probe_rule() -> dict[str, torch.Tensor]:
    from megatron_iso.ops.gdn.reference import l2norm as l2_ref

    gen = torch.Generator().manual_seed(4021)
    t, hk, hv, d = 45, 2, 4, 32
    q = l2_ref(torch.randn(t, hk, d, generator=gen)).cuda()
    k = l2_ref(torch.randn(t, hk, d, generator=gen)).cuda()
    v = torch.randn(t, hv, d, generator=gen).cuda()
    g, beta = gdn_gates(torch.randn(t, hv, generator=gen).cuda(), torch.randn(t, hv, generator=gen).cuda(),
                        torch.zeros(hv, device="cuda"), torch.ones(hv, device="cuda"))  # fmt: skip
    cu = torch.tensor([0, 19, 45], device="cuda")
    return {"chunk16": gated_delta_rule(q, k, v, g, beta, cu, chunk=16).cpu()}


def _probe_conv() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4022)
    x, w = torch.randn(11, 300, generator=gen).cuda(), torch.randn(300, 4, generator=gen).cuda()
    cu = torch.tensor([0, 2, 11], device="cuda")
    return {"fp32": causal_conv1d(x, w, cu).cpu(), "bf16": causal_conv1d(x.bfloat16(), w.bfloat16(), cu).cpu()}


def _probe_gates() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4023)
    a, b = torch.randn(9, 4, generator=gen).cuda() * 4, torch.randn(9, 4, generator=gen).cuda()
    g, beta = gdn_gates(a, b, torch.randn(4, generator=gen).cuda(), torch.randn(4, generator=gen).cuda())
    return {"g": g.cpu(), "beta": beta.cpu(), "l2norm": l2norm(torch.randn(5, 3, 128, generator=gen).cuda()).cpu()}


_RULE_CONSTANTS = {
    "chunk_alignment": "position 0 of the sequence",
    "state_pass": "per chunk (closing chunks; chunk form: every chunk, rows past nrows zero): G by an ieee dot with "
    "the lower-triangular ones, T^-1's 16-row diagonal blocks X_bb by tl.fma chains over the rows above; scan form: WY "
    "form, block rows below by K-blocked dots, U0/W by dots, chain u = U0 - W E (ieee: K-blocked through memory, "
    "tensor-core precisions: whole-K dots from registers); chunk form: chain u by block forward substitution "
    "Y_b = beta v - (beta e^G k) E - sum_j<b A_bj u_j, u_b = X_bb Y_b (16-row blocks in registers); "
    "E' = e^G_C E + KD^T u; one program per (seq, head, Dv block)",
    # The form and the precision are the profile's (profile.gdn_form, profile.gdn_dot_precision, pinned constants of
    # the same contract); here what a null precision means per form.
    "form": "profile.gdn_form (scan or chunk)",
    "dot_precision": "profile.gdn_dot_precision (null: the form's default)",
    "dot_precision_defaults": [f"scan:{tuning.DOT_PRECISION}", f"chunk:{tuning.CHUNK_DOT_PRECISION}"],
    "chunk_form_precisions": list(tuning.CHUNK_FORM_PRECISIONS),
    "output": "scan: per-token recurrent scan from the chunk entry (or running) state, S[Dk, BV] in registers; "
    "chunk: O = e^G (Q E) + P u per (chunk, head, Dv block)",
    "decode": "scan: one scan step from the running state, state pass kernels re-run on the buffered chunk at its "
    "close; chunk: the token's X_bb row from the cached rows (the prep's fma chain), its A and P rows, its Y, u and o "
    "rows through the chain's 16-row tiles (Y, u rows cached), the exit at close",
    "decode_bv": tuning.DECODE_BV,
    "fp_contraction": "chunk form: off (enable_fp_fusion=False for prep, chain, output and decode kernels); scan: on",
    "decode_sum_one_dot": tuning.DECODE_SUM_ONE_DOT,  # the decode step's substitution sum as one dot
    "scan_bv": tuning.SCAN_BV,
    "inv_block": tuning.INV_BLOCK,
    "chain_bv_ieee_mma_bf16": [
        tuning.CHAIN_BV,
        tuning.CHAIN_BV_MMA,
        tuning.CHAIN_BV_BF16,
    ],  # the chain's Dv block per dot path
    "out_bv_decode_rows": [tuning.OUT_BV, tuning.DECODE_ROWS],
    "warps_scan_chain_prep_out": [tuning.SCAN_WARPS, tuning.CHAIN_WARPS, tuning.PREP_WARPS, tuning.OUT_WARPS],
    "block_k": "max(16, next_pow2(Dk))",
    "exp": "tl.exp (fp32)",
    "inputs": "read in their own dtype (fp32/bf16/fp16, widened in-kernel) at their row stride; other dtypes or "
    "non-contiguous inner dims copied to contiguous fp32",
    "chunk_buffer": "scan: written by the scan kernel (after prep); chunk: by _buffer_kernel, last",
    "intermediates": "bf16 chain dots: W, KD (chunk form: u, entry states) stored as bf16, the dots' own rounding; "
    "else fp32",
    "backward": "triton chunk backward (gdn_triton_backward: local, chain, output, WY kernels) at the chain's "
    "precision, from the chunk-form state pass (kept by the chunk form, recomputed after the scan form)",
    "triton": triton.__version__,
}
for _op, _fn, _probe, _consts in (
    ("gated_delta_rule", gated_delta_rule, _probe_rule, _RULE_CONSTANTS),
    ("gdn_conv1d", causal_conv1d, _probe_conv,
     {"sum": "sequential fp32 over K (FMA contraction allowed)", "silu": "acc / (1 + tl.exp(-acc)), div_rn",
      "block_channels": tuning.CONV_BC, "backward": "conv_backward: two triton kernels, fp32, fixed row blocks",
      "triton": triton.__version__}),
    ("gdn_gates", gdn_gates, _probe_gates,
     {"formula": "g: fp64 -exp(A_log) * (max(x,0) + log1p(exp(-|x|))), log1p = log(u) y/(u-1), rounded once; "
                 "beta: fp32 1/(1+exp(-b)) div_rn",
      "block": tuning.ELEM_BLOCK, "triton": triton.__version__}),
    ("gdn_l2norm", l2norm, _probe_gates,
     {"eps": L2NORM_EPS, "reduction": "one row per program, tl.sum over next_pow2(D)", "sqrt_div": "sqrt_rn, div_rn",
      "backward": "norm_backward_triton row-norm kernel, fp32", "triton": triton.__version__}),
):  # fmt: skip
    register(
        OpImpl(
            op=_op,
            impl_id=f"{_op}.triton",
            version=VERSION,
            device_class="cuda",
            profile=Profile.CORRECTNESS,
            fn=_fn,
            constants=_consts,
            equivalence_note=(
                "training, prefill and decode run the same kernels: the per-token scan from a bitwise-equal start "
                "state, the state-pass kernels on the same (entry, chunk) data (tests/gpu/test_gdn_triton.py)"
            ),
            probe=_probe,
        )
    )
