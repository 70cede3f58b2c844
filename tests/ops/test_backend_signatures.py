"""Every implementation registered for an op answers its family's backend Protocol (``ops/<family>/backend.py``).

All op modules are imported, the Triton ones included (importing them registers the cuda/correctness entries and
compiles nothing), so the check covers every device class and profile, not only what runs on the CPU."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import megatron_iso.ops
from megatron_iso import registry
from megatron_iso.ops.common.signatures import Signature, protocol_parameters, signature_mismatches
from megatron_iso.ops.moe import native as moe_native
from megatron_iso.ops.moe import reference as moe_reference
from megatron_iso.ops.moe.backend import RoutingBackend

FAMILIES = ("activation", "attention", "gdn", "gemm", "logprob", "moe", "norm", "rope")


@pytest.fixture(scope="module")
def signatures() -> dict[str, Signature]:
    pytest.importorskip("triton")
    for mod in pkgutil.walk_packages(megatron_iso.ops.__path__, "megatron_iso.ops."):
        importlib.import_module(mod.name)
    out: dict[str, Signature] = {}
    for family in FAMILIES:
        for sig in importlib.import_module(f"megatron_iso.ops.{family}.backend").SIGNATURES:
            assert sig.op not in out, f"op {sig.op} declared twice"
            out[sig.op] = sig
    return out


def test_every_op_family_declares_its_backend() -> None:
    have = sorted(p.name for p in pkgutil.iter_modules(megatron_iso.ops.__path__) if p.ispkg and p.name != "common")
    assert have == sorted(FAMILIES)


def test_every_registered_implementation_answers_its_protocol(signatures) -> None:
    ops_impls = [i for i in registry.registered() if i.fn.__module__.startswith("megatron_iso.ops.")]
    assert {i.device_class for i in ops_impls} == set(registry.DEVICE_CLASSES)
    undeclared = sorted({i.op for i in ops_impls} - set(signatures))
    assert undeclared == [], "ops registered without a backend Protocol"
    bad = {}
    for impl in ops_impls:
        sig = signatures[impl.op]
        problems = signature_mismatches(protocol_parameters(sig.protocol), impl.fn, sig.extras.get(impl.impl_id, ()))
        if problems:
            bad[f"{impl.ref} ({impl.device_class}, {impl.profile})"] = problems
    assert bad == {}
    stale = sorted(
        (sig.op, impl_id)
        for sig in signatures.values()
        for impl_id in sig.extras
        if not any(i.op == sig.op and i.impl_id == impl_id for i in ops_impls)
    )
    assert stale == [], "extras declared for implementations that are not registered"


@pytest.mark.parametrize("module", [moe_reference, moe_native], ids=["reference", "native"])
def test_moe_routing_modules_answer_the_routing_protocol(module) -> None:
    members = [n for n, v in vars(RoutingBackend).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert len(members) == 4
    bad = {
        n: problems
        for n in members
        if (problems := signature_mismatches(protocol_parameters(RoutingBackend, n), getattr(module, n)))
    }
    assert bad == {}


def _proto(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, *, zero_centered: bool = False) -> torch.Tensor: ...


def test_the_check_finds_each_kind_of_mismatch() -> None:
    want = list(inspect.signature(_proto).parameters.values())

    def renamed(x, weight, eps=1e-6, *, zero_centered=False): ...
    def no_default(x, w, eps, *, zero_centered=False): ...
    def missing_kw(x, w, eps=1e-6): ...
    def extra_kw(x, w, eps=1e-6, *, zero_centered=False, tile=None): ...
    def extra_kw_required(x, w, eps=1e-6, *, zero_centered=False, tile): ...
    def variadic(x, w, eps=1e-6, *, zero_centered=False, **kw): ...
    def good(x, w, eps=1e-6, *, zero_centered=False): ...

    assert signature_mismatches(want, good) == []
    assert signature_mismatches(want, extra_kw, ("tile",)) == []
    assert "positional ['x', 'weight', 'eps']" in signature_mismatches(want, renamed)[0]
    assert signature_mismatches(want, no_default) == ["'eps' has no default, the protocol gives it one"]
    assert signature_mismatches(want, missing_kw) == ["keyword-only ['zero_centered'] missing"]
    assert "['tile'] not in the protocol" in signature_mismatches(want, extra_kw)[0]
    assert signature_mismatches(want, extra_kw_required, ("tile",)) == ["extra keyword-only ['tile'] without a default"]
    assert signature_mismatches(want, variadic) == ["variadic parameters ['kw']"]


def test_register_per_device_gives_each_device_its_own_fields() -> None:
    """The one registration helper of the native paths: shared fields, plus what ``fields_for`` says per device."""

    def cuda_only(device_class: str) -> dict:
        if device_class != "cuda":
            return {}
        return {"constants": {"rollout": "lib"}, "case_impls": {"decode": "lib.decode@1"}, "equivalence_note": "none"}

    kwargs = {"op": "test_fields_op", "impl_id": "test_fields.native", "version": "1", "fn": len}
    keys = [("test_fields_op", d, registry.Profile.PERFORMANCE) for d in registry.DEVICE_CLASSES]
    try:
        cpu, cuda = registry.register_per_device(
            **kwargs, profile=registry.Profile.PERFORMANCE, constants={"a": 1}, fields_for=cuda_only
        )
        assert (cpu.device_class, dict(cpu.constants), dict(cpu.case_impls), cpu.equivalence_note) == (
            "cpu",
            {"a": 1},
            {},
            "",
        )
        assert dict(cuda.constants) == {"a": 1, "rollout": "lib"} and cuda.impl_for("decode") == "lib.decode@1"
        assert cuda.equivalence_note == "none"
        with pytest.raises(ValueError, match=r"fields_for gave \['probe'\]; allowed keys"):
            registry.register_per_device(
                **kwargs, profile=registry.Profile.CORRECTNESS, constants={}, fields_for=lambda d: {"probe": None}
            )
    finally:
        for key in keys:
            registry._REGISTRY.pop(key, None)
