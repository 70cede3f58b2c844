"""The carried GDN Triton rule (``ops.gdn.triton.carry``, context parallelism's state chain) on a CUDA device, at
Qwen3.5's GDN layer (Hk 16, Hv 32, Dk = Dv = 128, chunk 64; the gradients against the CPU reference at 2 / 4 heads of
that shape, as tests/gpu/test_gdn_triton.py's backward test).

Bitwise (int32 views), per variant (the scan form at its registered precision; the chunk form at ieee, tf32 and its
default bf16): a packed call cut at chunk boundaries into carried calls == one plain call; each exit == the entry
state a prefill leaves in a state cache; a sequence closing no chunk exits with its entry; the chunk form's cut calls'
gradients == one call's. With tolerances: gradients of q, k, v, g, beta and the entry against fp64 autograd of the
CPU reference carry (test_gdn_triton.py's per-variant tolerances), deterministic and the same bits whether the state
pass was kept; the scan form's cut gradients against one call's. The dispatch: ``ops.gdn.carries_state`` holds on
cuda/correctness (so the model's CP path takes the state chain there) and routes to these kernels.
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import same_bits
from megatron_iso.testing.gdn_inputs import random_gdn_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

HK, HV, D, C = 16, 32, 128, 64  # Qwen3.5's GDN layer
VARIANTS = ["scan:", "chunk:ieee", "chunk:tf32", "chunk:bf16"]
# relative, against fp64 autograd of the reference (tests/gpu/test_gdn_triton.py's BACKWARD_TOLERANCE)
TOLERANCE = {"scan:": 1e-4, "chunk:ieee": 1e-4, "chunk:tf32": 1e-2, "chunk:bf16": 3e-2}


def kwargs(variant: str) -> dict:
    form, _, prec = variant.partition(":")
    return {"chunk": C, "form": form, "dot_precision": prec or None}


def cu(lengths: list[int], device: str = "cuda") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)


@pytest.fixture(scope="module")
def mods():
    from megatron_iso.ops.gdn.triton import carry, rule

    return rule, carry


@pytest.mark.parametrize("variant", VARIANTS)
def test_cut_calls_equal_one_call(mods, variant):
    from megatron_iso.ops.gdn import GDNLayerState

    gt, gcar = mods
    kw = kwargs(variant)
    x = random_gdn_inputs(300, 71, hk=HK, hv=HV, dk=D, dv=D, device="cuda")
    whole = gt.gated_delta_rule(*x, cu([37, 263]), **kw)  # sequence 1: rows 37..299
    zeros = torch.zeros(2, HV, D, D, device="cuda")
    b1, b2 = 37 + C, 37 + 3 * C  # rows of sequence 1's chunk boundaries C and 3C (each call runs past its cut)
    a, exit_a = gcar.gated_delta_rule_carry(*(t[: b1 + C // 3] for t in x), cu([37, C + C // 3]), zeros, **kw)
    b, exit_b = gcar.gated_delta_rule_carry(*(t[b1 : b2 + C // 8] for t in x), cu([b2 + C // 8 - b1]), exit_a[1:], **kw)
    c, exit_c = gcar.gated_delta_rule_carry(*(t[b2:] for t in x), cu([300 - b2]), exit_b, **kw)
    d, exit_d = gcar.gated_delta_rule_carry(*(t[b1:b2] for t in x), cu([b2 - b1]), exit_a[1:], **kw)
    assert same_bits(torch.cat([a[:b1], b[: b2 - b1], c]), whole), "cut calls vs one call"
    assert same_bits(d, whole[b1:b2]) and same_bits(exit_d, exit_b), "a call ending on a boundary"
    assert same_bits(exit_a[0], zeros[0]), "a sequence closing no chunk keeps its entry"
    for rows, got in ((slice(37, b2 + C // 8), exit_b[0]), (slice(37, 300), exit_c[0])):
        st = GDNLayerState.allocate(2, conv_dim=4, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D,
                                    value_dim=D, chunk=C, dtype=torch.float32, device="cuda", form=kw["form"])  # fmt: skip
        n = rows.stop - rows.start
        gt.gated_delta_rule(*(t[rows] for t in x), cu([n]), state=st, slots=torch.tensor([1], device="cuda"),
                            starts=torch.tensor([0], device="cuda"), **kw)  # fmt: skip
        assert same_bits(got, st.entry[1]), f"exit after {n} rows vs the state cache's entry"


def carry_grads(gcar, x, entry, cu_, w, w_exit, **kw) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_(True) for t in (*x, entry)]
    out, exit_ = gcar.gated_delta_rule_carry(*leaves[:5], cu_, leaves[5], **kw)
    ((out * w).sum() + (exit_ * w_exit).sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("variant", VARIANTS)
def test_carry_backward_close_to_reference(mods, variant):
    from megatron_iso.ops.gdn import reference as ref

    _, gcar = mods
    kw = kwargs(variant)
    hk, hv, lengths = 2, 4, [150, 64, 37]  # an open last chunk, one ending on a boundary, one closing no chunk
    gen = torch.Generator().manual_seed(8)
    x = random_gdn_inputs(251, 19, hk=hk, hv=hv, dk=D, dv=D, device="cuda")
    entry = (torch.randn(3, hv, D, D, generator=gen) * 0.1).cuda()
    w, w_exit = torch.randn(251, hv, D, generator=gen).cuda(), torch.randn(3, hv, D, D, generator=gen).cuda()
    first = carry_grads(gcar, x, entry, cu(lengths), w, w_exit, **kw)
    again = carry_grads(gcar, x, entry, cu(lengths), w, w_exit, **kw)
    recomputed = carry_grads(gcar, x, entry, cu(lengths), w, w_exit, keep_states=False, **kw)
    names = ("q", "k", "v", "g", "beta", "entry")
    for name, p, p2, p3 in zip(names, first, again, recomputed, strict=True):
        assert same_bits(p, p2) and same_bits(p, p3), f"grad {name}: not deterministic, or changed by keep_states"
    lr = [t.cpu().double().requires_grad_(True) for t in x] + [entry.cpu().requires_grad_(True)]
    out, exit_ = ref.gated_delta_rule_carry(*lr[:5], cu(lengths, "cpu"), lr[5], chunk=C)
    ((out * w.cpu().double()).sum() + (exit_ * w_exit.cpu().double()).sum()).backward()
    for name, p, r in zip(names, first, lr, strict=True):
        rel = float((p.cpu().double() - r.grad.double()).abs().max() / r.grad.abs().max())
        assert rel < TOLERANCE[variant], f"grad {name}: relative error {rel:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_cut_gradients_equal_one_call(mods, variant):
    """Chunk form: bitwise (the cut chain hands over the uncut chain's fp32 dE; the rows the first call ran past the
    cut get exact zeros from it). Scan form: its backward runs the chunk form's chain from the scan form's exit, so
    the second call's entry differs from the uncut chain's state in the last bits; within its tolerance."""
    gt, gcar = mods
    kw = kwargs(variant)
    x = random_gdn_inputs(300, 61, hk=HK, hv=HV, dk=D, dv=D, device="cuda")
    w = torch.randn(300, HV, D, generator=torch.Generator().manual_seed(2)).cuda()
    leaves = [t.clone().requires_grad_(True) for t in x]
    (gt.gated_delta_rule(*leaves, cu([37, 263]), **kw) * w).sum().backward()
    cut = [t.clone().requires_grad_(True) for t in x]
    b1 = 37 + 2 * C
    zeros = torch.zeros(2, HV, D, D, device="cuda")
    first, exits = gcar.gated_delta_rule_carry(*(t[: b1 + C // 2] for t in cut), cu([37, 2 * C + C // 2]), zeros, **kw)
    second, _ = gcar.gated_delta_rule_carry(*(t[b1:] for t in cut), cu([300 - b1]), exits[1:], **kw)
    (torch.cat([first[:b1], second]) * w).sum().backward()
    for name, a, b in zip("qkvgb", cut, leaves, strict=True):
        if kw["form"] == "chunk":
            assert same_bits(a.grad, b.grad), f"grad {name}: max |d| {(a.grad - b.grad).abs().max():.3e}"
        else:
            rel = float((a.grad - b.grad).abs().max() / b.grad.abs().max())
            assert rel < TOLERANCE[variant], f"grad {name}: relative difference {rel:.2e}"


def test_dispatch_carries_on_cuda():
    from megatron_iso.ops import gdn

    assert gdn.carries_state("cuda", "correctness", "chunk", "bf16") and not gdn.carries_state("cuda", "performance")
    x = random_gdn_inputs(70, 3, hk=2, hv=4, dk=D, dv=D, device="cuda")
    entry = torch.zeros(1, 4, D, D, device="cuda")
    out, exit_ = gdn.gated_delta_rule_carry(*x, cu([70]), entry, chunk=C, form="chunk", dot_precision="bf16")
    plain = gdn.gated_delta_rule(*x, cu([70]), chunk=C, form="chunk", dot_precision="bf16")
    assert same_bits(out, plain) and exit_.shape == (1, 4, D, D)
