"""The carried GDN Triton rule (``ops.gdn.triton.carry``) under TRITON_INTERPRET=1, run as a script by
tests/ops/test_gdn_triton_interpret.py (a subprocess, as ``gdn_triton_interpret_check.py``, whose shapes and helpers
it shares: chunk 8, Dk = Dv = 8).

Per form (scan; chunk at ieee and at bf16 dots): a packed call cut at chunk boundaries into carried calls, each
entering with the exit of the one before, gives every row the uncut plain rule's bits; each exit is bitwise the state
a prefill leaves in a state cache's ``entry`` (the same chain), and a sequence that closes no chunk exits with its
entry. Backward (scan and chunk form, Dk != Dv): deterministic, the same bits whether the forward kept its state pass,
and within 1e-5 (relative) of fp64 autograd of the reference carry for q, k, v, g, beta and the entry, with a
gradient on the exit; the cut calls' gradients bitwise one uncut call's (chunk form).
"""

# ruff: noqa: E402
from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

allow_runtime_loop_bounds()

import time

import torch
from gdn_triton_interpret_check import HK, HV, C, D, cu, inputs, new_state

from megatron_iso.ops.gdn import reference as ref
from megatron_iso.ops.gdn.triton import carry as gcar
from megatron_iso.ops.gdn.triton import rule as gt
from megatron_iso.testing.bits import same_bits
from megatron_iso.testing.gdn_inputs import random_gdn_inputs

t_start = time.time()
HK1, HV1 = HK // 2, HV // 2  # half the heads of the interpreter check: the same paths in half the time
VARIANTS = (("scan", None), ("chunk", "ieee"), ("chunk", "bf16"))


def check_forward(form: str, prec: str | None) -> None:
    kw = {"chunk": C, "form": form, "dot_precision": prec}
    x = inputs(32, 71, hk=HK1, hv=HV1)
    whole = gt.gated_delta_rule(*x, cu([5, 27]), **kw)  # sequence 1: rows 5..31, chunk boundaries at rows 13, 21, 29
    zeros = torch.zeros(2, HV1, D, D)
    # A runs past boundary 16 (row 21) into the open chunk; B restarts there and stops past boundary 24 (row 29); C
    # restarts at 24 and closes no chunk; D from 16 ends exactly on boundary 24
    a, exit_a = gcar.gated_delta_rule_carry(*(t[:24] for t in x), cu([5, 19]), zeros, **kw)
    b, exit_b = gcar.gated_delta_rule_carry(*(t[21:31] for t in x), cu([10]), exit_a[1:], **kw)
    c, exit_c = gcar.gated_delta_rule_carry(*(t[29:] for t in x), cu([3]), exit_b, **kw)
    d, exit_d = gcar.gated_delta_rule_carry(*(t[21:29] for t in x), cu([8]), exit_a[1:], **kw)
    assert same_bits(torch.cat([a[:21], b[:8], c]), whole), f"{form}/{prec}: cut calls vs one call"
    assert same_bits(d, whole[21:29]), f"{form}/{prec}: a call ending on a boundary"
    assert same_bits(exit_a[0], zeros[0]) and same_bits(exit_c, exit_b), f"{form}/{prec}: no chunk closed, exit moved"
    assert same_bits(exit_d, exit_b), f"{form}/{prec}: the state at boundary 24 differs between calls"
    # the exit == the entry state a prefill of the same rows leaves in a state cache (slot 1)
    st = new_state(2, hk=HK1, hv=HV1, form=form)
    gt.gated_delta_rule(*(t[5:31] for t in x), cu([26]), state=st, slots=torch.tensor([1]), starts=torch.tensor([0]),
                        **kw)  # fmt: skip
    assert same_bits(exit_b[0], st.entry[1]), f"{form}/{prec}: exit vs the state cache's entry"
    if prec != "bf16":  # the interpreter's bf16 dot is not a bf16 dot: only the bits above are meaningful
        _, want = ref.gated_delta_rule_carry(*(t[21:31] for t in x), cu([10]), exit_a[1:], chunk=C)
        assert float((exit_b - want).abs().max()) < 1e-5, f"{form}/{prec}: exit vs the reference carry"
    print(f"carry forward ok ({form}/{prec})", round(time.time() - t_start, 1))


def carry_grads(x, entry, cu_, w, w_exit, check_forward: bool = False, **kw) -> list[torch.Tensor]:
    """Gradients of ``(out * w).sum() + (exit * w_exit).sum()`` for q, k, v, g, beta and the entry; ``check_forward``:
    first hold the forward under autograd to the plain forward's bits."""
    leaves = [t.clone().requires_grad_(True) for t in (*x, entry)]
    out, exit_ = gcar.gated_delta_rule_carry(*leaves[:5], cu_, leaves[5], **kw)
    if check_forward:
        plain = gcar.gated_delta_rule_carry(*x, cu_, entry, **kw)
        assert same_bits(out.detach(), plain[0]) and same_bits(exit_.detach(), plain[1]), f"{kw}: bits under autograd"
    ((out * w).sum() + (exit_ * w_exit).sum()).backward()
    return [t.grad for t in leaves]


def check_backward() -> None:
    gen = torch.Generator().manual_seed(8)
    lengths = [11, 8, 3]  # an open last chunk, one closing on a boundary, one closing no chunk
    for form, prec, dv in (("scan", None, D), ("chunk", "ieee", 12)):
        x = random_gdn_inputs(22, 19, hk=HK1, hv=HV1, dk=D, dv=dv)
        entry = torch.randn(3, HV1, D, dv, generator=gen) * 0.3
        w, w_exit = torch.randn(22, HV1, dv, generator=gen), torch.randn(3, HV1, D, dv, generator=gen)
        kw = {"chunk": C, "form": form, "dot_precision": prec}
        first = carry_grads(x, entry, cu(lengths), w, w_exit, check_forward=True, **kw)
        # the scan form recomputes the state pass either way (so this is a second run), the chunk form keeps it
        recomputed = carry_grads(x, entry, cu(lengths), w, w_exit, keep_states=False, **kw)
        for name, p, p2 in zip(("q", "k", "v", "g", "beta", "entry"), first, recomputed, strict=True):
            assert same_bits(p, p2), f"{form}: grad {name} not deterministic or changed with keep_states=False"
        # fp64 autograd of the reference carry (its entry must be fp32: the inputs' fp64 promotes the arithmetic)
        lr = [t.double().requires_grad_(True) for t in x] + [entry.clone().requires_grad_(True)]
        out, exit_ = ref.gated_delta_rule_carry(*lr[:5], cu(lengths), lr[5], chunk=C)
        ((out * w.double()).sum() + (exit_ * w_exit.double()).sum()).backward()
        for name, p, r in zip(("q", "k", "v", "g", "beta", "entry"), first, lr, strict=True):
            e = float((p.double() - r.grad.double()).abs().max() / r.grad.abs().max())
            assert e < 1e-5, f"{form} Dv {dv} grad {name} vs the reference carry: {e:.2e}"
        print(f"carry backward ok ({form})", round(time.time() - t_start, 1))
    # the cut calls' gradients (through the carried state and the rows both calls read) vs one uncut call's
    x = inputs(32, 61, hk=HK1, hv=HV1)
    w = torch.randn(32, HV1, D, generator=gen)
    kw = {"chunk": C, "form": "chunk", "dot_precision": "ieee"}
    leaves = [t.clone().requires_grad_(True) for t in x]
    (gt.gated_delta_rule(*leaves, cu([5, 27]), **kw) * w).sum().backward()
    cut = [t.clone().requires_grad_(True) for t in x]
    first, exits = gcar.gated_delta_rule_carry(*(t[:24] for t in cut), cu([5, 19]), torch.zeros(2, HV1, D, D), **kw)
    second, _ = gcar.gated_delta_rule_carry(*(t[21:] for t in cut), cu([11]), exits[1:], **kw)
    (torch.cat([first[:21], second]) * w).sum().backward()
    # bitwise in the chunk form: the cut chain hands over the uncut chain's fp32 dE at the boundary, and the rows the
    # first call ran past the cut get exact zeros from it (their outputs are dropped). The scan form's backward runs
    # the chunk form's chain from the scan form's exit, so there the entry differs in the last bits (GPU test).
    for name, a, b in zip("qkvgb", cut, leaves, strict=True):
        assert same_bits(a.grad, b.grad), f"cut calls' grad {name} vs one call's: {(a.grad - b.grad).abs().max():.2e}"
    print("carry cut backward ok", round(time.time() - t_start, 1))


if __name__ == "__main__":
    for variant in VARIANTS:
        check_forward(*variant)
    check_backward()
    print("carry parts ok")
