"""The GDN family's argument checks (ops.gdn.checks) are one set: the reference, the native path and the Triton
package's host side refuse the same bad calls with the same message."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.gdn import GDNLayerState, native, reference
from megatron_iso.testing.gdn_inputs import random_gdn_inputs

HK, HV, D, C = 2, 4, 8, 8


def _state(slots: int, chunk: int = C) -> GDNLayerState:
    return GDNLayerState.allocate(
        slots, conv_dim=6, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D, value_dim=D, chunk=chunk,
        dtype=torch.float32,
    )  # fmt: skip


def _rule_call(case: str):
    q, k, v, g, beta = random_gdn_inputs(5, 3, hk=HK, hv=HV, dk=D, dv=D)
    cu = torch.tensor([0, 2, 5])
    kw: dict = {"chunk": C}
    if case == "continues without a state":
        kw["starts"] = torch.tensor([0, 3])
    elif case == "a state without slots":
        kw |= {"state": _state(2), "starts": torch.tensor([0, 3])}
    elif case == "too few starts":
        kw["starts"] = torch.tensor([0])
    elif case == "negative start":
        kw["starts"] = torch.tensor([0, -1])
    elif case == "g of other heads":
        g = g[:, :HK]
    elif case == "value heads not a multiple":
        v, g, beta = v[:, :3], g[:, :3], beta[:, :3]
    elif case == "chunk 0":
        kw["chunk"] = 0
    elif case == "state of another chunk":
        kw |= {"state": _state(2, chunk=16), "slots": torch.tensor([0, 1])}
    return (q, k, v, g, beta, cu), kw


RULE_CASES = [
    ("continues without a state", r"positions \[0, 3\] need their GDN state cache \(state="),
    ("a state without slots", r"a GDN state cache needs one slot per sequence"),
    ("too few starts", r"starts has 1 entries for 2 sequences"),
    ("negative start", r"starts must be >= 0, got \[0, -1\]"),
    ("g of other heads", r"do not fit q/k \[T, Hk, Dk\], v \[T, Hv, Dv\], g/beta \[T, Hv\]"),
    ("value heads not a multiple", r"value heads 3 must be a multiple of key heads 2"),
    ("chunk 0", r"chunk must be a positive int, got 0"),
    ("state of another chunk", r"state cache chunk 16 != chunk 8"),
]


@pytest.mark.parametrize(("case", "pattern"), RULE_CASES)
def test_reference_and_native_rule_refuse_alike(case, pattern):
    args, kw = _rule_call(case)
    for impl in (reference, native):
        with pytest.raises(ValueError, match=pattern):
            impl.gated_delta_rule(*args, **kw)


@pytest.mark.parametrize(("case", "pattern"), [c for c in RULE_CASES if c[0] in (
    "g of other heads", "value heads not a multiple", "chunk 0", "state of another chunk")])  # fmt: skip
def test_triton_rule_refuses_the_reference_calls_alike(case, pattern):
    pytest.importorskip("triton")
    from megatron_iso.ops.gdn.triton import rule

    args, kw = _rule_call(case)
    with pytest.raises(ValueError, match=pattern):  # refused on the host, before any kernel
        rule.gated_delta_rule(*args, **kw)


@pytest.mark.parametrize(("case", "pattern"), [c for c in RULE_CASES if c[0] in (
    "continues without a state", "a state without slots", "too few starts", "negative start")])  # fmt: skip
def test_triton_plan_refuses_the_reference_calls_alike(case, pattern):
    pytest.importorskip("triton")
    from megatron_iso.ops.gdn.triton import plan

    (_, _, _, _, _, cu), kw = _rule_call(case)
    with pytest.raises(ValueError, match=pattern):
        plan._plan(cu, kw.get("starts"), kw.get("slots"), C, "state" in kw, torch.device("cpu"), 2, "chunk")


def test_empty_sequence_is_refused_by_the_reference_and_the_triton_plan():
    pytest.importorskip("triton")
    from megatron_iso.ops.gdn.triton import plan

    q, k, v, g, beta = random_gdn_inputs(5, 3, hk=HK, hv=HV, dk=D, dv=D)
    cu = torch.tensor([0, 5, 5])
    pattern = r"sequences \[1\] have no tokens in cu_seqlens=\[0, 5, 5\]"
    with pytest.raises(ValueError, match=pattern):
        reference.gated_delta_rule(q, k, v, g, beta, cu, chunk=C)
    with pytest.raises(ValueError, match=pattern):
        plan._plan(cu, None, None, C, False, torch.device("cpu"), 0, "chunk")


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"weight": torch.ones(5, 4)}, r"causal_conv1d: weight shape \(5, 4\) != \(channels=6, kernel\)"),
        ({"starts": torch.tensor([0, 2])}, r"positions \[0, 2\] need their conv state \(conv_state="),
        ({"conv_state": torch.zeros(2, 6, 3)}, r"a conv state needs one slot per sequence"),
    ],
)
def test_conv_implementations_refuse_alike(kw, pattern):
    x, cu = torch.randn(5, 6), torch.tensor([0, 2, 5])
    weight = kw.pop("weight", torch.ones(6, 4))
    impls = [reference, native]
    try:
        from megatron_iso.ops.gdn.triton import conv_gates
    except ImportError:  # no triton: the CPU implementations only
        conv_gates = None
    impls += [conv_gates] if conv_gates is not None else []
    for impl in impls:
        with pytest.raises(ValueError, match=pattern):
            impl.causal_conv1d(x, weight, cu, **kw)
