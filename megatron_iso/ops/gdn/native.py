"""Gated DeltaNet native path: what stock stacks do (HF transformers' torch fallbacks, FLA's split).

Training and prefill run a chunked algorithm (library matmuls, triangular solve, chunks aligned at the
start of the call); a one-token decode step runs the plain recurrence (``.sum`` reductions). The two
are different arithmetic, so decode drifts from the training forward: the gap this package removes.
Only ``state.running`` and ``state.conv`` of the cache are used.

On CUDA, where FLA is installed, the rollout's calls of the rule (a state cache given, no autograd) run FLA's chunk
kernel (prefill) and fused recurrent kernel (decode steps) instead (:mod:`.fla_stock`, which says why the trainer,
its scoring included, stays on the torch chunk algorithm).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from megatron_iso.ops.gdn import fla_stock
from megatron_iso.ops.gdn.checks import check_conv_args, check_rule_args, check_state_slots
from megatron_iso.ops.gdn.reference import DEFAULT_CHUNK, L2NORM_EPS, _starts
from megatron_iso.ops.gdn.state_cache import GDNLayerState
from megatron_iso.registry import Profile, register_per_device


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.conv1d`` (depthwise, history from ``conv_state``) + ``F.silu``, in x's dtype; the call's
    sequences run as one zero-padded batch."""
    cu, st = _starts(cu_seqlens, starts)
    check_state_slots(conv_state is not None, slots, len(st), st, conv=True)
    check_conv_args(x, weight)
    cd, kw = weight.shape
    lens = [b - a for a, b in itertools.pairwise(cu)]
    if not lens:
        return x[:0]
    longest = max(lens)
    segs = pad_sequence([x[a:b] for a, b in itertools.pairwise(cu)], batch_first=True)  # [B, L, Cd]
    prev = torch.zeros(len(lens), kw - 1, cd, dtype=x.dtype, device=x.device)
    if conv_state is not None:
        slot_ids = slots.to(device=x.device, dtype=torch.long)
        resumed = torch.tensor([s > 0 for s in st], device=x.device)
        prev = torch.where(resumed[:, None, None], conv_state[slot_ids].transpose(1, 2).to(x.dtype), prev)
    ext = torch.cat([prev, segs], 1)  # [B, K-1+L, Cd]
    y = (
        F.silu(F.conv1d(ext.transpose(1, 2), weight[:, None], groups=cd)).transpose(1, 2)  # [B, L, Cd]
        if longest
        else ext[:, :0]  # only empty sequences: no output rows (F.conv1d refuses an input shorter than K)
    )
    src = torch.cat([torch.arange(n) + j * longest for j, n in enumerate(lens)]).to(x.device)
    if conv_state is not None:
        # Each sequence's last K-1 inputs (its history when it had fewer tokens than that).
        last = (torch.tensor(lens)[:, None] + torch.arange(kw - 1)).to(x.device)
        tail = ext.gather(1, last[..., None].expand(-1, -1, cd))
        conv_state[slot_ids] = tail.transpose(1, 2).detach().to(conv_state.dtype)
    return y.reshape(-1, cd)[src]


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """HF/FLA: ``x * rsqrt(sum(x^2) + eps)`` in fp32."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Qwen3-Next: ``g = -A_log.float().exp() * softplus(a.float() + dt_bias)``, ``beta = b.sigmoid()``."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), b.sigmoid().float()


def _intra_chunk(q, k, v, g, beta):
    """The per-chunk terms of every chunk at once (``[..., C, D]`` / ``[..., C]`` inputs): what the chunk loop reads.

    ``T^-1`` of the unit lower triangular ``T = I + A`` comes from one triangular solve against the identity, and
    U0, W from matmuls with it: the backward needs ``T^-T`` as well, and a solve per right-hand side cost more
    (three batched solves took 12.8 of 109 ms fwd+bwd at 8 x 4096 tokens, 32 heads; one takes 1.6 ms)."""
    chunk = k.shape[-2]
    gc = g.cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)
    dec = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()
    kb = k * beta[..., None]
    strict_lower = ~upper & ~torch.eye(chunk, dtype=torch.bool, device=k.device)
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    system = eye + ((kb @ k.transpose(-1, -2)) * dec).masked_fill(~strict_lower, 0)
    tinv = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    eg, decay_to_end = gc.exp(), (gc[..., -1:] - gc).exp()
    return {
        "gc": gc, "dec": dec, "kb": kb, "strict_lower": strict_lower, "tinv": tinv, "eg": eg,
        "decay_to_end": decay_to_end,
        "u0": tinv @ (v * beta[..., None]),
        "w": tinv @ (kb * eg[..., None]),
        "attn": (q @ k.transpose(-1, -2)) * dec,
        "q_dec": q * eg[..., None],
        "k_dec": k * decay_to_end[..., None],
        "s_dec": gc[..., -1, None, None].exp(),
    }  # fmt: skip


def _chunk_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, nc, ...]`` -> contiguous ``[nc, B * H, ...]``: chunk c is then one contiguous batch of matrices, so
    the loop's matmuls read it in place (a strided chunk view was copied for every matmul: 15.6 of those 109 ms)."""
    return x.movedim(2, 0).flatten(1, 2).contiguous()


def _batch_major(x: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of :func:`_chunk_major`."""
    return x.unflatten(1, (b, -1)).movedim(0, 2)


class _ChunkRule(torch.autograd.Function):
    """The chunk loop over ``[B, H, nc, C, ...]`` chunks from states ``s0``, with a hand-written backward.

    Forward: the per-chunk terms of all chunks at once, then, chunk after chunk, ``u = U0 - W S``,
    ``o = (q e^G) S + attn u``, ``S = e^{G_C} S + (k e^{G_C - G})^T u``. Autograd of that loop stored every chunk's
    operands and, in its backward, ran ~12 small matmuls per chunk plus a full-size zero gradient per indexed
    operand; here the backward keeps only the two chain matmuls per chunk sequential (the state gradient) and does
    the rest for all chunks at once, from the per-chunk terms and entry states saved by the forward. Chunk-major
    layout inside (:func:`_chunk_major`). Deterministic (fixed-order matmuls, solve and reductions, no atomics)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0):  # type: ignore[override]
        b = k.shape[0]
        q, k, v, g, beta = (_chunk_major(x) for x in (q, k, v, g, beta))
        t = _intra_chunk(q, k, v, g, beta)
        k_dec_t = t["k_dec"].transpose(-1, -2)
        outs, entry, s = [], [], s0.flatten(0, 1)
        for c in range(k.shape[0]):
            entry.append(s)
            u = torch.baddbmm(t["u0"][c], t["w"][c], s, alpha=-1)
            outs.append(torch.baddbmm(t["attn"][c] @ u, t["q_dec"][c], s))
            s = torch.baddbmm(s * t["s_dec"][c], k_dec_t[c], u)
        ctx.b = b
        ctx.names = list(t)
        ctx.save_for_backward(q, k, v, beta, torch.stack(entry), *t.values())
        return _batch_major(torch.stack(outs), b), s.unflatten(0, (b, -1))

    @staticmethod
    def backward(ctx, d_o, d_last):  # type: ignore[override]
        q, k, v, beta, s_in, *terms = ctx.saved_tensors
        t = dict(zip(ctx.names, terms, strict=True))
        mT = lambda x: x.transpose(-1, -2)  # noqa: E731
        d_o = _chunk_major(d_o)
        u = torch.baddbmm(t["u0"].flatten(0, 1), t["w"].flatten(0, 1), s_in.flatten(0, 1), alpha=-1).view_as(t["u0"])
        # The chain backward: dS (gradient of a chunk's exit state) runs from the last chunk to the first.
        du_local = mT(t["attn"]) @ d_o
        ds_local = mT(t["q_dec"]) @ d_o
        w_t = mT(t["w"])
        ds = torch.zeros_like(s_in[0]) if d_last is None else d_last.flatten(0, 1)
        d_exit, du = [], []
        for c in reversed(range(s_in.shape[0])):
            d_exit.append(ds)
            du_c = torch.baddbmm(du_local[c], t["k_dec"][c], ds)
            du.append(du_c)
            ds = torch.baddbmm(torch.addcmul(ds_local[c], ds, t["s_dec"][c]), w_t[c], du_c, alpha=-1)
        d_s0 = ds.unflatten(0, (ctx.b, -1))
        d_exit, du = torch.stack(d_exit[::-1]), torch.stack(du[::-1])
        # Everything else for all chunks at once.
        d_attn = d_o @ mT(u)
        d_qdec = d_o @ mT(s_in)
        d_kdec = u @ mT(d_exit)
        d_sdec = (d_exit * s_in).sum((-1, -2))
        # U0 = T^-1 (beta v), W = T^-1 (beta e^G k): d(rhs) = T^-T dU, dT = -d(rhs) U^T.
        tinv_t = mT(t["tinv"])
        d_x1 = tinv_t @ du
        d_x2 = -(tinv_t @ (du @ mT(s_in)))
        d_m = -(d_x1 @ mT(t["u0"]) + d_x2 @ mT(t["w"])) * t["strict_lower"]
        kk, qk = t["kb"] @ mT(k), q @ mT(k)
        d_kk = d_m * t["dec"]  # d(kb k^T)
        d_qk = d_attn * t["dec"]  # d(q k^T)
        e = (d_m * kk + d_attn * qk) * t["dec"]  # d dec * dec: dec[t, i] = exp(G_t - G_i)
        eg, eg_last = t["eg"], t["s_dec"][..., 0, 0]
        x2 = t["kb"] * eg[..., None]
        d_kb = d_kk @ k + d_x2 * eg[..., None]
        d_q = d_qk @ k + d_qdec * eg[..., None]
        d_k = mT(d_kk) @ t["kb"] + mT(d_qk) @ q + d_kdec * t["decay_to_end"][..., None] + d_kb * beta[..., None]
        f = (d_kdec * t["k_dec"]).sum(-1)
        d_gc = e.sum(-1) - e.sum(-2) + (d_qdec * t["q_dec"]).sum(-1) + (d_x2 * x2).sum(-1) - f
        d_gc[..., -1] += f.sum(-1) + d_sdec * eg_last
        d_g = d_gc.flip(-1).cumsum(-1).flip(-1)
        d_v = d_x1 * beta[..., None]
        d_beta = (d_x1 * v).sum(-1) + (d_kb * k).sum(-1)
        return (*(_batch_major(x, ctx.b) for x in (d_q, d_k, d_v, d_g, d_beta)), d_s0)


def _chunked(q, k, v, g, beta, s, chunk):
    """Sequences and heads first (q/k ``[B, H, L, Dk]``, v ``[B, H, L, Dv]``, g/beta ``[B, H, L]``), from
    states s ``[B, H, Dk, Dv]``. Zero-padded tokens (g = beta = k = 0) leave a state as it was."""
    b, h, n, _ = k.shape
    pad = -n % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    nc = (n + pad) // chunk
    q, k, v = (x.reshape(b, h, nc, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, nc, chunk), beta.reshape(b, h, nc, chunk)
    o, s = _ChunkRule.apply(q, k, v, g, beta, s)
    return o.reshape(b, h, nc * chunk, -1)[:, :, :n], s


def _recurrent(q, k, v, g, beta, s):
    """The plain per-token recurrence (HF ``torch_recurrent_gated_delta_rule``), layout as :func:`_chunked`."""
    outs = []
    for t in range(k.shape[-2]):
        s = s * g[..., t].exp()[..., None, None]
        u = (v[..., t, :] - (s * k[..., t, :, None]).sum(-2)) * beta[..., t, None]
        s = s + k[..., t, :, None] * u[..., None, :]
        outs.append((s * q[..., t, :, None]).sum(-2))
    return torch.stack(outs, -2), s


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
) -> torch.Tensor:
    """Same signature as the reference; chunked for multi-token calls, recurrent for decode steps. A rollout call on
    CUDA runs FLA's kernels where FLA is installed (:func:`.fla_stock.rollout_rule`).

    All decode steps of a call run as one batch, and all multi-token sequences as another
    (zero-padded to the longest), so the cost in launches does not grow with the number of sequences."""
    cu, st = _starts(cu_seqlens, starts)
    check_state_slots(state is not None, slots, len(st), st)
    check_rule_args(q, k, v, g, beta, chunk, state)
    hk, dk = k.shape[1:]
    hv, dv = v.shape[1:]
    rep = hv // hk
    scale = dk**-0.5 if scale is None else scale
    if fla_stock.serves(q, state, k, v, g, beta):  # the rollout on CUDA: FLA's kernels, as stock stacks run it
        return fla_stock.rollout_rule(q, k, v, g, beta, cu_seqlens, cu, st, scale=scale, state=state, slots=slots)
    qh = q.float().repeat_interleave(rep, 1) * scale
    kh = k.float().repeat_interleave(rep, 1)
    out = torch.empty(q.shape[0], hv, dv, dtype=torch.float32, device=q.device)
    lens = [b - a for a, b in itertools.pairwise(cu)]
    decode = [i for i, n in enumerate(lens) if st[i] > 0 and n == 1]
    chunked = [i for i, n in enumerate(lens) if n > 1 or (n == 1 and st[i] == 0)]
    for group, rule in ((decode, _recurrent), (chunked, functools.partial(_chunked, chunk=chunk))):
        if not group:
            continue
        longest = max(lens[i] for i in group)
        # [B, H, L, ...] per input, sequences zero-padded to the longest.
        args = [
            pad_sequence([x[cu[i] : cu[i + 1]] for i in group], batch_first=True).transpose(1, 2).float()
            for x in (qh, kh, v, g, beta)
        ]
        s0 = torch.zeros(len(group), hv, dk, dv, device=q.device)
        if state is not None:
            slot_ids = slots[group].to(device=q.device, dtype=torch.long)
            resumed = torch.tensor([st[i] > 0 for i in group], device=q.device)
            s0 = torch.where(resumed[:, None, None, None], state.running[slot_ids], s0)
        o, s = rule(*args, s0)
        src = torch.cat([torch.arange(lens[i]) + j * longest for j, i in enumerate(group)]).to(q.device)
        dst = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in group]).to(q.device)
        out[dst] = o.transpose(1, 2).reshape(-1, hv, dv)[src]
        if state is not None:
            state.running[slot_ids] = s.detach()
    return out


def _probe_rule(device: str = "cpu") -> dict[str, torch.Tensor]:
    from megatron_iso.ops.gdn.reference import _probe_inputs

    q, k, v, g, beta = _probe_inputs()
    return {"chunk8": gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 13, 21]), chunk=8)}


_RULE_CONSTANTS = {"train_prefill": "chunked (call-aligned), matmul", "decode": "recurrent"}


def _fla_fields(device_class: str) -> dict[str, Any]:
    """cuda with FLA installed: the rollout's prefill and decode cases are FLA's kernels (fla_stock), and the entry
    says so; the trainer's cases stay this module's torch code. A stock path claims no equality between them."""
    if device_class != "cuda" or not fla_stock.installed():
        return {}
    constants, case_impls = fla_stock.registry_entry()
    return {
        "constants": constants,
        "case_impls": case_impls,
        "equivalence_note": "none claimed: stock execution, the mismatch baseline",
    }


register_per_device(
    op="gated_delta_rule",
    impl_id="gated_delta_rule.native",
    # 2: one triangular inverse + matmuls (was a solve per right-hand side), chunk-major loop with fused matmul-adds.
    version="2",
    profile=Profile.PERFORMANCE,
    fn=gated_delta_rule,
    constants=_RULE_CONSTANTS,
    probe_for=lambda device: functools.partial(_probe_rule, device),
    fields_for=_fla_fields,
)
for _op, _fn, _consts in (
    ("gdn_conv1d", causal_conv1d, {"formula": "F.conv1d + F.silu"}),
    ("gdn_gates", gdn_gates, {"formula": "hf qwen3-next"}),
    ("gdn_l2norm", l2norm, {"formula": "x * rsqrt(sum(x^2) + eps)", "eps": L2NORM_EPS}),
):
    register_per_device(
        op=_op, impl_id=f"{_op}.native", version="1", profile=Profile.PERFORMANCE, fn=_fn, constants=_consts
    )
