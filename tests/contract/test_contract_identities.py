"""Which config changes move which identity, and the canonical form under them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_iso import registry
from megatron_iso.contract import Contract, ContractFormatError, canonical_json, sha256_of
from megatron_iso.contract.canonical import CanonicalError, diff_paths
from tests.contract.conftest import contract_of

pytestmark = pytest.mark.usefixtures("fake_registry")


def ids(cfg) -> dict[str, str]:
    return contract_of(cfg).identities.to_dict()


def changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {k for k in a if a[k] != b[k]}


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.tp=2"],
        ["model=tiny_moe", "parallel.ep=4"],  # EP splits routed experts: a dense model refuses EP > 1
        ["parallel.sp=true"],
        ["parallel.dp=16"],
        ["parallel.pp=2"],
        ["parallel.cp=2"],  # the rollout (CP 1) and a CP 2 trainer hold one numerical_policy (profile.cp_domain)
    ],
    ids=lambda o: o[-1],
)
def test_neutral_layout_changes_only_deployment(cfg_for, overrides):
    base = overrides[:-1]
    assert changed(ids(cfg_for(*base)), ids(cfg_for(*overrides))) == {"deployment"}


@pytest.mark.parametrize(
    "override",
    [
        "profile.leaves=16",
        "profile.leaves=4,profile.tp_domain=[1,2,4]",
        "profile.gdn_chunk=32",
        "profile.attention_kv_block=128",
        "device=cuda",
        "profile=performance",
    ],
)
def test_policy_changes_move_numerical_policy_not_semantic(cfg_for, override):
    # commas inside [] belong to a list value; split only the top-level ones
    overrides = override.replace(",profile", " profile").split(" ")
    diff = changed(ids(cfg_for()), ids(cfg_for(*overrides)))
    assert "numerical_policy" in diff
    assert "semantic" not in diff


def test_gdn_form_moves_numerical_policy_and_is_named(cfg_for):
    """A trainer on the scan form and a rollout on the chunk form (or another dot precision) do not handshake."""
    base = cfg_for("device=cuda", "profile.gdn_form=scan")
    for override in ("profile.gdn_form=chunk", "profile.gdn_dot_precision=bf16"):
        assert changed(ids(base), ids(cfg_for("device=cuda", override))) == {"numerical_policy"}
    a = contract_of(base).to_dict()["numerical_policy"]
    b = contract_of(cfg_for("device=cuda", "profile.gdn_form=chunk")).to_dict()["numerical_policy"]
    assert diff_paths(a, b) == [("constants.gdn_form", "scan", "chunk")]


def test_auto_gdn_form_is_pinned_resolved(cfg_for):
    """profile.gdn_form=auto (the default) is pinned as the form it resolves to: a side on auto and a side naming that
    form handshake; on the CPU auto is the scan form, on cuda the chunk form."""
    for device, form in (("cuda", "chunk"), ("cpu", "scan")):
        auto = contract_of(cfg_for(f"device={device}"))
        assert auto.numerical_policy.constants["gdn_form"] == form
        assert ids(cfg_for(f"device={device}")) == ids(cfg_for(f"device={device}", f"profile.gdn_form={form}"))
    assert ids(cfg_for("device=cuda")) != ids(cfg_for("device=cuda", "profile.gdn_form=scan"))


def test_leaves_change_is_named_in_policy_diff(cfg_for):
    a = contract_of(cfg_for()).to_dict()["numerical_policy"]
    b = contract_of(cfg_for("profile.leaves=16")).to_dict()["numerical_policy"]
    assert diff_paths(a, b) == [("constants.leaves", 8, 16)]


def test_impl_version_changes_numerical_policy(cfg_for):
    before = ids(cfg_for())
    old = registry.lookup("fake_gemm", "cpu", "correctness")
    registry._REGISTRY[("fake_gemm", "cpu", "correctness")] = dataclasses.replace(old, version="2")
    after = contract_of(cfg_for())
    assert changed(before, after.identities.to_dict()) == {"numerical_policy"}
    assert after.numerical_policy.entry("fake_gemm", "prefill").impl == "fake_gemm.correctness@2"


def test_impl_constant_changes_numerical_policy(cfg_for):
    before = ids(cfg_for())
    old = registry.lookup("fake_gemm", "cpu", "correctness")
    registry._REGISTRY[old.op, "cpu", "correctness"] = dataclasses.replace(
        old, constants={**old.constants, "tile_m": 32}
    )
    assert changed(before, ids(cfg_for())) == {"numerical_policy"}


def test_performance_profile_pins_tp(cfg_for):
    c1 = contract_of(cfg_for("profile=performance"))
    c2 = contract_of(cfg_for("profile=performance", "parallel.tp=2"))
    assert c1.numerical_policy.claims.axis("tp").kind == "pinned"
    assert c2.numerical_policy.claims.axis("tp").value == 2
    assert c1.identities.numerical_policy != c2.identities.numerical_policy
    assert c1.numerical_policy.claims.axis("batch").kind == "unclaimed"


def test_correctness_claims(cfg_for):
    claims = contract_of(cfg_for()).numerical_policy.claims
    tp = claims.axis("tp")
    assert (tp.kind, tp.domain, tp.tolerance) == (
        "invariant",
        [1, 2, 4],
        0,
    )  # tiny_dense: 4 KV groups, TP 8 cannot shard
    assert claims.axis("sp").domain == [False, True]
    assert claims.axis("dp").kind == "neutral"
    assert claims.parity["tolerance"] == 0 and claims.parity["kind"] == "bitwise"
    rules = {(r.state, r.event, r.action) for r in claims.invalidation}
    assert ("prefix_cache", "weight_sync", "flush") in rules


def test_model_change_moves_semantic(cfg_for):
    diff = changed(ids(cfg_for()), ids(cfg_for("model.num_layers=3")))
    assert "semantic" in diff
    diff = changed(ids(cfg_for()), ids(cfg_for("contract.max_batch=8")))
    assert "semantic" in diff


def test_floats_are_bit_patterns_and_cases_have_limits(cfg_for):
    d = contract_of(cfg_for()).to_dict()
    assert d["semantic"]["architecture"]["norm_epsilon"] == registry.float_bits(1e-6)
    assert d["numerical_policy"]["composition"]["fake_gemm"]["decode"]["constants"]["alpha"] == registry.float_bits(1.0)
    assert d["semantic"]["cases"]["decode"]["tokens_per_step"] == 1
    assert d["semantic"]["cases"]["prefill"]["max_seq_len"] == 512
    assert set(d["semantic"]["cases"]) == set(registry.CASES)
    assert d["semantic"]["op_vocabulary"] == ["fake_attention", "fake_gemm", "fake_logprob"]
    # the whole document is canonical: no float anywhere
    canonical_json(d)


def test_asymmetric_entry_records_per_case_impl_and_note(cfg_for):
    pol = contract_of(cfg_for()).numerical_policy
    assert pol.entry("fake_attention", "decode").impl == "fake_attention_decode.correctness@1"
    assert pol.entry("fake_attention", "prefill").impl == "fake_attention.correctness@1"
    assert "fixed blocks" in pol.entry("fake_attention", "decode").equivalence_note


def test_canonical_json_rejects_floats_with_path():
    with pytest.raises(CanonicalError, match=r"\$\.a\.b\[1\] = 0\.5"):
        canonical_json({"a": {"b": [1, 0.5]}})
    with pytest.raises(CanonicalError, match="key 1"):
        canonical_json({1: "x"})
    assert canonical_json({"b": 1, "a": [True, None, "é"]}) == '{"a":[true,null,"\\u00e9"],"b":1}'
    assert sha256_of({"a": 1}) == sha256_of({"a": 1}) != sha256_of({"a": True})


def test_roundtrip_and_tamper_detection(cfg_for):
    c = contract_of(cfg_for())
    d = json.loads(canonical_json(c.to_dict()))
    again = Contract.from_dict(d)
    assert again.identities == c.identities
    assert again.to_dict() == c.to_dict()

    d["numerical_policy"]["constants"]["leaves"] = 16  # edited without re-hashing
    with pytest.raises(ContractFormatError, match=r"identities\.numerical_policy"):
        Contract.from_dict(d)

    d = json.loads(canonical_json(c.to_dict()))
    d["schema"] = "megatron_iso.contract/0"
    with pytest.raises(ContractFormatError, match="schema"):
        Contract.from_dict(d)

    d = json.loads(canonical_json(c.to_dict()))
    del d["numerical_policy"]["claims"]
    with pytest.raises(ContractFormatError, match="missing field 'claims'"):
        Contract.from_dict(d)


def test_diff_paths_orders_and_marks_absent():
    a = {"x": {"b": 1, "a": [1, 2]}, "only_a": 1}
    b = {"x": {"b": 2, "a": [1, 3]}, "only_b": True}
    assert diff_paths(a, b) == [
        ("only_a", 1, "<absent>"),
        ("only_b", "<absent>", True),
        ("x.a[1]", 2, 3),
        ("x.b", 1, 2),
    ]
    assert diff_paths({"k": 1}, {"k": True}) == [("k", 1, True)]
