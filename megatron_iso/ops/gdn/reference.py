"""Gated DeltaNet, CPU reference path: CPR (chunkwise-parallel recurrent) semantics, invariant by construction.

One numerical semantics for the training forward, prefill of any length and token-by-token decode: chunks aligned
at position 0 of the sequence, a fixed-tree state pass (:func:`chunk_state_pass`) between chunks, and the per-token
output scan (:func:`_scan`) from each chunk's entry state. Only elementwise IEEE operations, ``ops.common.tree`` sums
and the IEEE-composed ``exp``, so a token's bits never depend on the batch, the call boundaries or the other heads.
Differentiable by autograd (deterministic on CPU).

Design: docs/GDN.md, "The recurrence" and "CPR: one semantics for training, prefill and decode".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_iso.ops.common.ieee_math import exp64, iso_exp, iso_silu, sigmoid64, softplus64
from megatron_iso.ops.common.tensor_keyed_cache import TensorKeyedCache
from megatron_iso.ops.common.tree import tree_sum_dim
from megatron_iso.ops.gdn.checks import (
    check_conv_args,
    check_entry,
    check_nonempty,
    check_rule_args,
    check_starts,
    check_state_slots,
)
from megatron_iso.ops.gdn.state_cache import GDNLayerState, check_value_buffer
from megatron_iso.registry import OpImpl, Profile, register

DEFAULT_CHUNK = 64
L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------- helpers
# Every GDN layer of a forward gets the same two tensors: only the first reads them back (a host sync on a GPU).
_HOST_LISTS: TensorKeyedCache[tuple[list[int], list[int]]] = TensorKeyedCache(8)


def _starts(cu_seqlens: torch.Tensor, starts: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """Host lists ``(cu, starts)`` of a call, validated; cached across the layers of a forward."""
    return _HOST_LISTS.get((cu_seqlens, starts), None, lambda: _read_starts(cu_seqlens, starts))


def _read_starts(cu_seqlens: torch.Tensor, starts: torch.Tensor | None) -> tuple[list[int], list[int]]:
    flat = cu_seqlens.reshape(-1).to(torch.int64)
    if starts is not None:
        flat = torch.cat([flat, starts.reshape(-1).to(device=flat.device, dtype=torch.int64)])
    values = flat.tolist()  # one read for both
    n = cu_seqlens.numel() - 1
    cu = values[: n + 1]
    st = values[n + 1 :] if starts is not None else [0] * n
    check_starts(st, n)
    return cu, st


# ------------------------------------------------------------------------------------------- conv
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over packed rows: ``x [T, Cd]``, ``weight [Cd, K]`` -> ``[T, Cd]`` (x dtype).

    Output t of a sequence is ``silu(sum_j w[:, j] * x[t - K + 1 + j])`` with inputs before the
    sequence's first token taken from ``conv_state[slot]`` (zeros at position 0). The K products are
    fp32 and summed with the fixed tree. ``conv_state [slots, Cd, K-1]`` is updated in place with
    each sequence's last K-1 inputs.
    """
    cu, st = _starts(cu_seqlens, starts)
    check_state_slots(conv_state is not None, slots, len(st), st, conv=True)
    check_conv_args(x, weight)
    cd = x.shape[1]
    kw = weight.shape[-1]
    hist = kw - 1
    zeros = torch.zeros(hist, cd, dtype=x.dtype, device=x.device)
    ext, rows = [], []
    base = 0
    for i in range(len(cu) - 1):
        prev = zeros if st[i] == 0 else conv_state[int(slots[i])].t().to(x.dtype)
        seg = x[cu[i] : cu[i + 1]]
        ext += [prev, seg]
        n = cu[i + 1] - cu[i]
        rows.append(base + torch.arange(n, device=x.device))
        base += hist + n
    ext_all = torch.cat(ext)  # per sequence: K-1 history rows, then its tokens
    idx = torch.cat(rows)[:, None] + torch.arange(kw, device=x.device)[None, :]  # [T, K]
    prod = ext_all[idx].float() * weight.t().float()[None]  # [T, K, Cd]
    y = iso_silu(tree_sum_dim(prod, 1)).to(x.dtype)
    if conv_state is not None:
        with torch.no_grad():
            for i in range(len(cu) - 1):
                end = cu[i + 1] + (i + 1) * hist  # end of sequence i in ext_all
                conv_state[int(slots[i])] = ext_all[end - hist : end].t().to(conv_state.dtype)
    return y


# --------------------------------------------------------------------------------- norms and gates
def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fp32 ``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA / HF Qwen3-Next), tree-summed."""
    xf = x.float()
    inv = 1.0 / torch.sqrt(tree_sum_dim(xf * xf, -1) + torch.tensor(eps, dtype=torch.float32))
    return xf * inv.unsqueeze(-1)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, each computed in
    float64 from IEEE-composed functions and rounded once (``a, b [T, Hv]``; ``A_log, dt_bias [Hv]``)."""
    g = -(exp64(A_log.double()) * softplus64(a.double() + dt_bias.double()))
    return g.float(), sigmoid64(b.double()).float()


# ------------------------------------------------------------------------------------ CPR kernels
def _tree_dot(x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    return tree_sum_dim(x * y, dim)


def _step(
    s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step on ``s [..., H, Dk, Dv]`` (q/k ``[..., H, Dk]``, v ``[..., H, Dv]``, decay/beta ``[..., H]``)."""
    s = s * decay[..., None, None]
    u = (v - _tree_dot(s, k[..., :, None], -2)) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return s, _tree_dot(s, q[..., :, None], -2)


def chunk_state_pass(
    entry: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Exit state of full chunks: ``entry [B, H, Dk, Dv]``, k ``[B, C, H, Dk]``, v ``[B, C, H, Dv]``,
    g/beta ``[B, C, H]`` (fp32) -> ``[B, H, Dk, Dv]``.

    With G_t = g_1 + ... + g_t (sequential), the rule unrolls to
    ``u_t = beta_t (v_t - e^{G_t} E^T k_t) - sum_{i<t} beta_t e^{G_t - G_i} (k_t.k_i) u_i`` (forward
    substitution, one tree sum over i per t) and ``S = e^{G_C} E + sum_t e^{G_C - G_t} k_t u_t^T``.
    """
    c = k.shape[1]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, C, D]
    gh, bh = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, C]
    cum = [gh[..., 0]]
    for t in range(1, c):
        cum.append(cum[-1] + gh[..., t])
    gc = torch.stack(cum, -1)  # [B, H, C]
    lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril(-1)
    diff = torch.where(lower, gc[..., :, None] - gc[..., None, :], torch.zeros((), device=k.device))
    gram = _tree_dot(kh[..., :, None, :], kh[..., None, :, :], -1)  # [B, H, C, C]
    a = torch.where(lower, bh[..., None] * iso_exp(diff) * gram, torch.zeros((), device=k.device))
    ek = _tree_dot(entry[:, :, None], kh[..., None], -2)  # [B, H, C, Dv]: E^T k_t
    rhs = bh[..., None] * (vh - iso_exp(gc)[..., None] * ek)
    u = [rhs[:, :, 0]]
    for t in range(1, c):
        us = torch.stack(u, 2)  # [B, H, t, Dv]
        u.append(rhs[:, :, t] - tree_sum_dim(a[:, :, t, :t, None] * us, 2))
    us = torch.stack(u, 2)
    w = iso_exp(gc[..., -1:] - gc)  # [B, H, C]: e^{G_C - G_t}
    upd = tree_sum_dim((w[..., None] * kh)[..., :, None] * us[..., None, :], 2)  # [B, H, Dk, Dv]
    return iso_exp(gc[..., -1])[..., None, None] * entry + upd


@dataclass
class _Segment:
    seq: int
    a: int  # packed rows [a, b)
    b: int
    offset: int  # position of row a inside its chunk
    closes: bool  # the segment's last token ends its chunk
    first: bool  # first segment of its sequence in this call


def _segments(cu: list[int], starts: list[int], chunk: int) -> list[_Segment]:
    out = []
    for i in range(len(cu) - 1):
        a, pos = cu[i], starts[i]
        while a < cu[i + 1]:
            o = pos % chunk
            b = min(cu[i + 1], a + chunk - o)
            out.append(_Segment(i, a, b, o, o + b - a == chunk, a == cu[i]))
            pos += b - a
            a = b
    return out


def _scan(
    init: torch.Tensor, segs: list[_Segment], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay, beta
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All segments' recurrent scans at once, one token step at a time.

    ``init [S, H, Dk, Dv]``; q/k/v/decay/beta packed ``[T, ...]``. Returns (packed rows, their
    outputs ``[n, H, Dv]``, final states ``[S, H, Dk, Dv]``). A segment past its end keeps its state.
    """
    lens = torch.tensor([s.b - s.a for s in segs])
    steps = int(lens.max())
    starts = torch.tensor([s.a for s in segs])
    idx = (starts[:, None] + torch.arange(steps)[None, :]).clamp_max(q.shape[0] - 1)  # [S, steps]
    state, outs = init, []
    for t in range(steps):
        r = idx[:, t]
        new, o = _step(state, q[r], k[r], v[r], decay[r], beta[r])
        active = (t < lens)[:, None, None, None]
        state = torch.where(active, new, state)
        outs.append(o)
    out = torch.stack(outs, 1)  # [S, steps, H, Dv]
    valid = torch.arange(steps)[None, :] < lens[:, None]
    return idx[valid], out[valid], state


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
    """CPR gated delta rule over packed sequences; returns fp32 ``[T, Hv, Dv]``.

    q/k ``[T, Hk, Dk]`` (l2-normalised), v ``[T, Hv, Dv]``, g (log decay) / beta ``[T, Hv]``; value
    head j reads key head ``j // (Hv // Hk)``. ``starts[i]`` is sequence i's position (0 = fresh; > 0
    needs ``state`` and ``slots``); ``state`` is updated in place (running, entry, chunk buffer).
    """
    cu, st = _starts(cu_seqlens, starts)
    check_state_slots(state is not None, slots, len(st), st)
    check_nonempty(cu)
    check_rule_args(q, k, v, g, beta, chunk, state)
    if state is not None:
        check_value_buffer(state, v.dtype, "gated_delta_rule")
    n, (hv, dv), dk = len(cu) - 1, v.shape[1:], k.shape[2]
    zero = torch.zeros(n, hv, dk, dv, dtype=torch.float32, device=q.device)
    fresh = torch.tensor([s == 0 for s in st], device=q.device)[:, None, None, None]
    if state is None:
        running = entry = zero
    else:
        running = torch.where(fresh, zero, state.running[slots])
        entry = torch.where(fresh, zero, state.entry[slots])
    out, finals, cur_entry, segs, inputs = _rule(q, k, v, g, beta, cu, st, running, entry, scale, chunk, state, slots)
    if state is not None:
        _write_state(state, slots, segs, finals, cur_entry, *inputs)
    return out


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over sequences that each begin on one of their own chunk boundaries, entering with ``entry [n, Hv, Dk,
    Dv]`` (fp32; zeros at a sequence's first token): ``(out [T, Hv, Dv], exit [n, Hv, Dk, Dv])``, ``exit[i]`` the state
    at sequence i's last chunk boundary (the entry state of the chunk its last rows leave open; after its last row when
    it ends on a boundary). Both differentiable in every input and in ``entry``; no state cache.

    The same arithmetic as :func:`gated_delta_rule`: a sequence run whole, or cut at chunk boundaries into calls that
    each carry ``exit`` on as the next call's ``entry``, gives every row the same bits (context parallelism,
    ``models.gdn_context``: the rows after the cut chunk boundary are the next call's first rows)."""
    cu, st = _starts(cu_seqlens, None)
    check_nonempty(cu)
    check_rule_args(q, k, v, g, beta, chunk, None)
    n, (hv, dv), dk = len(cu) - 1, v.shape[1:], k.shape[2]
    check_entry(entry, n, hv, dk, dv)
    out, _, cur_entry, _, _ = _rule(q, k, v, g, beta, cu, st, entry, entry, scale, chunk, None, None)
    return out, torch.stack(cur_entry)


def _rule(q, k, v, g, beta, cu, st, running, entry, scale, chunk, state, slots):
    """The CPR rule from each sequence's ``running`` (scan) and ``entry`` (state pass) states ``[n, Hv, Dk, Dv]``:
    (out, each segment's final scan state, each sequence's last entry state, the segments, fp32 k/v/g/beta)."""
    hk, dk = k.shape[1:]
    hv, dv = v.shape[1:]
    rep = hv // hk
    scale = dk**-0.5 if scale is None else scale
    kf, vf, gf, bf = k.float(), v.float(), g.float(), beta.float()
    kh = kf.repeat_interleave(rep, 1)
    qh = q.float().repeat_interleave(rep, 1) * torch.tensor(scale, dtype=torch.float32)
    decay = iso_exp(gf)
    n = len(cu) - 1
    segs = _segments(cu, st, chunk)

    # State pass chain: round j closes each sequence's j-th chunk of this call, from its entry state.
    closing = [[s for s in segs if s.seq == i and s.closes] for i in range(n)]
    cur_entry = list(entry.unbind(0))
    seg_init: dict[int, torch.Tensor] = {}  # id(segment) -> scan start state
    for i in range(n):
        seg_init[id(next(s for s in segs if s.seq == i))] = running[i]
    for j in range(max((len(c) for c in closing), default=0)):
        batch = [c[j] for c in closing if len(c) > j]
        ks, vs, gs, bs = [], [], [], []
        for s in batch:
            rows = slice(s.a, s.b)
            if s.offset:  # the chunk's first tokens arrived in earlier calls: the buffer holds them
                slot = int(slots[s.seq])
                ks.append(torch.cat([state.buf_k[slot, : s.offset].repeat_interleave(rep, 1), kh[rows]]))
                vs.append(torch.cat([state.buf_v[slot, : s.offset], vf[rows]]))
                gs.append(torch.cat([state.buf_g[slot, : s.offset], gf[rows]]))
                bs.append(torch.cat([state.buf_beta[slot, : s.offset], bf[rows]]))
            else:
                ks.append(kh[rows])
                vs.append(vf[rows])
                gs.append(gf[rows])
                bs.append(bf[rows])
        ent = torch.stack([cur_entry[s.seq] for s in batch])
        exits = chunk_state_pass(ent, torch.stack(ks), torch.stack(vs), torch.stack(gs), torch.stack(bs))
        for s, e in zip(batch, exits.unbind(0), strict=True):
            cur_entry[s.seq] = e
            nxt = segs.index(s) + 1
            if nxt < len(segs) and segs[nxt].seq == s.seq:
                seg_init[id(segs[nxt])] = e

    rows, outs, finals = _scan(torch.stack([seg_init[id(s)] for s in segs]), segs, qh, kh, vf, decay, bf)
    out = torch.zeros(q.shape[0], hv, dv, dtype=torch.float32, device=q.device).index_put((rows,), outs)
    return out, finals, cur_entry, segs, (kf, vf, gf, bf)


@torch.no_grad()
def _write_state(state, slots, segs, finals, cur_entry, k, v, g, beta) -> None:
    """Each sequence's running state, open chunk's entry state and buffered tokens after this call."""
    last = {s.seq: (j, s) for j, s in enumerate(segs)}
    for i, (j, s) in last.items():
        slot = int(slots[i])
        state.entry[slot] = cur_entry[i]
        state.running[slot] = cur_entry[i] if s.closes else finals[j]
        if not s.closes:
            o, rows = s.offset, slice(s.a, s.b)
            state.buf_k[slot, o : o + s.b - s.a] = k[rows]
            state.buf_v[slot, o : o + s.b - s.a] = v[rows]
            state.buf_g[slot, o : o + s.b - s.a] = g[rows]
            state.buf_beta[slot, o : o + s.b - s.a] = beta[rows]


# ----------------------------------------------------------------------------------------- probes
def _probe_inputs(t: int = 21, hk: int = 2, hv: int = 4, d: int = 8):
    gen = torch.Generator().manual_seed(4011)
    q = l2norm(torch.randn(t, hk, d, generator=gen))
    k = l2norm(torch.randn(t, hk, d, generator=gen))
    v = torch.randn(t, hv, d, generator=gen)
    g, beta = gdn_gates(
        torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen), torch.zeros(hv), torch.ones(hv)
    )
    return q, k, v, g, beta


def _probe_rule() -> dict[str, torch.Tensor]:
    q, k, v, g, beta = _probe_inputs()
    cu = torch.tensor([0, 13, 21])
    return {"chunk8": gated_delta_rule(q, k, v, g, beta, cu, chunk=8)}


def _probe_conv() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4012)
    x, w = torch.randn(11, 12, generator=gen), torch.randn(12, 4, generator=gen)
    cu = torch.tensor([0, 2, 11])
    return {"fp32": causal_conv1d(x, w, cu), "bf16": causal_conv1d(x.bfloat16(), w.bfloat16(), cu)}


def _probe_gates() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4013)
    a, b, al, dt = (
        torch.randn(9, 4, generator=gen) * 4,
        torch.randn(9, 4, generator=gen),
        torch.randn(4, generator=gen),  # seeded like the rest: a probe digest must not follow the global RNG
        torch.randn(4, generator=gen),
    )
    g, beta = gdn_gates(a, b, al, dt)
    return {"g": g, "beta": beta, "l2norm": l2norm(torch.randn(5, 3, 16, generator=gen))}


_RULE_CONSTANTS = {
    "chunk_size": DEFAULT_CHUNK,
    "chunk_alignment": "position 0 of the sequence",
    "state_pass": "UT form: sequential cumsum of g, forward substitution, tree sums; fp32 chain over chunks",
    "output": "per-token recurrent scan from the chunk entry state, fp32, tree sums over Dk",
    "decode": "same scan from the running state; state pass re-run over the buffered chunk when it closes",
    "exp": "ieee_math.iso_exp (fp64 IEEE-composed, rounded once)",
    "q_scale": "Dk^-0.5 in fp32",
}
for _op, _fn, _probe, _consts in (
    ("gated_delta_rule", gated_delta_rule, _probe_rule, _RULE_CONSTANTS),
    ("gdn_conv1d", causal_conv1d, _probe_conv, {"sum": "tree over K fp32 products", "silu": "iso_silu"}),
    ("gdn_gates", gdn_gates, _probe_gates, {"formula": "fp64 IEEE-composed exp/softplus/sigmoid, one rounding"}),
    ("gdn_l2norm", l2norm, _probe_gates, {"eps": L2NORM_EPS, "reduction": "tree_sum_dim(x*x), 1/sqrt"}),
):
    register(
        OpImpl(
            op=_op,
            impl_id=f"{_op}.reference",
            version="1",
            device_class="cpu",
            profile=Profile.CORRECTNESS,
            fn=_fn,
            constants=_consts,
            equivalence_note=(
                "training, prefill and decode run this one function; chunked state and conv state make a "
                "call's bits independent of where earlier calls stopped (tests/ops/test_gdn.py)"
            ),
            probe=_probe,
        )
    )
