"""iso.lock.json: golden probe digests, divergence reports, and refusal of edited or corrupted files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_iso import registry
from megatron_iso.contract import LockfileError, read_lock, verify_lock, write_lock
from megatron_iso.contract.canonical import sha256_of
from megatron_iso.contract.lockfile import tensor_digest
from tests.contract.conftest import contract_of

pytestmark = pytest.mark.usefixtures("fake_registry")


@pytest.fixture
def lock_path(cfg_for, tmp_path):
    path = tmp_path / "iso.lock.json"
    write_lock(path, contract_of(cfg_for()), ["device=cpu"])
    return path


def test_lock_contents_and_clean_verify(lock_path, cfg_for):
    lock = read_lock(lock_path)
    assert set(lock["probes"]) == {"fake_attention", "fake_gemm"}  # fake_logprob has no probe
    assert set(lock["probes"]["fake_gemm"]) == {"decode", "trainer_forward"}
    assert lock["probes"]["fake_attention"]["decode"]["dtype"] == "bfloat16"
    assert lock["probes"]["fake_gemm"]["trainer_forward"]["shape"] == [4, 8]
    report = verify_lock(lock_path, contract_of(cfg_for()))
    assert report.ok and report.checked == 4 and report.lines() == []


def test_lock_file_is_byte_stable(lock_path, cfg_for, tmp_path):
    again = tmp_path / "again.json"
    write_lock(again, contract_of(cfg_for()), ["device=cpu"])
    assert again.read_bytes() == lock_path.read_bytes()


def test_changed_kernel_is_reported_by_op_and_case(lock_path, cfg_for):
    old = registry.lookup("fake_gemm", "cpu", "correctness")

    def drifted() -> dict[str, torch.Tensor]:
        out = dict(old.probe())
        out["trainer_forward"] = out["trainer_forward"].nextafter(torch.tensor(float("inf")))  # one ulp
        return out

    registry._REGISTRY[("fake_gemm", "cpu", "correctness")] = dataclasses.replace(old, probe=drifted)
    report = verify_lock(lock_path, contract_of(cfg_for()))
    assert not report.ok
    assert report.contract_diffs == []
    assert [(op, name, what) for op, name, what, _, _ in report.probe_mismatches] == [
        ("fake_gemm", "trainer_forward", "diverged")
    ]
    assert report.lines()[0].startswith("probe fake_gemm/trainer_forward: diverged")


def test_missing_and_new_probe_outputs(lock_path, cfg_for):
    old = registry.lookup("fake_attention", "cpu", "correctness")
    registry._REGISTRY[("fake_attention", "cpu", "correctness")] = dataclasses.replace(
        old, probe=lambda: {"prefill": old.probe()["prefill"], "extra": torch.zeros(1)}
    )
    what = {(name, w) for op, name, w, _, _ in verify_lock(lock_path, contract_of(cfg_for())).probe_mismatches}
    assert what == {("decode", "missing"), ("extra", "new")}


def test_policy_change_is_reported_as_contract_diff(lock_path, cfg_for):
    report = verify_lock(lock_path, contract_of(cfg_for("profile.leaves=16")))
    assert not report.ok
    assert report.contract_diffs == [("numerical_policy.constants.leaves", 8, 16)]
    # a neutral change is not a difference
    assert verify_lock(lock_path, contract_of(cfg_for("parallel.tp=2"))).ok


def _edit(path, fn) -> None:
    lock = json.loads(path.read_text())
    fn(lock)
    path.write_text(json.dumps(lock))


def test_hand_edited_lock_is_rejected(lock_path, cfg_for):
    _edit(lock_path, lambda d: d["probes"]["fake_gemm"]["decode"].update(sha256="0" * 64))
    with pytest.raises(LockfileError, match=r"self_digest mismatch.*edited by hand or corrupted"):
        verify_lock(lock_path, contract_of(cfg_for()))


def test_edit_with_recomputed_self_digest_still_rejected(lock_path):
    # a careful forger re-seals the file but cannot make the contract's identities match its body
    def forge(d):
        d["contract"]["numerical_policy"]["constants"]["gdn_chunk"] = 32
        body = {k: v for k, v in d.items() if k != "self_digest"}
        d["self_digest"] = sha256_of(body)

    _edit(lock_path, forge)
    with pytest.raises(LockfileError, match=r"identities\.numerical_policy=.*does not match the content"):
        read_lock(lock_path)


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda p: p.write_text(p.read_text()[:-40]), "not valid JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe" + p.read_bytes()), "cannot read lockfile"),
        (lambda p: p.write_text("[]"), "expected exactly the keys"),
        (lambda p: _edit(p, lambda d: d.update(extra=1)), "expected exactly the keys"),
        (lambda p: _edit(p, lambda d: d.update(lock_version=2)), "lock_version 2 unsupported"),
        (lambda p: _edit(p, lambda d: d["contract"].update(weight=0.5)), "not canonical.*decimal floats"),
        (lambda p: p.unlink(), "no such lockfile"),
    ],
)
def test_corrupted_lock_is_rejected(lock_path, mutate, pattern):
    mutate(lock_path)
    with pytest.raises(LockfileError, match=pattern):
        read_lock(lock_path)


def test_tensor_digest_covers_bytes_dtype_and_shape():
    x = torch.arange(6, dtype=torch.float32)
    d = tensor_digest(x)
    assert d == tensor_digest(x.clone())
    assert d["sha256"] == tensor_digest(x.reshape(2, 3))["sha256"] and d["shape"] != [2, 3]
    assert tensor_digest(x.view(torch.int32))["dtype"] == "int32"
    assert tensor_digest(x.reshape(2, 3).t())["sha256"] != tensor_digest(x.reshape(3, 2))["sha256"]
    assert tensor_digest(-0.0 * torch.ones(1)) != tensor_digest(torch.zeros(1))  # bits, not values
    assert tensor_digest(torch.tensor(1.5, dtype=torch.bfloat16))["shape"] == []
    assert tensor_digest(torch.empty(0, 3))["shape"] == [0, 3]
