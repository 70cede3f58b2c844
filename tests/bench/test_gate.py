"""iso-gate: pass only when the candidate is faster AND the numbers do not move (or a new policy is declared)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megatron_iso import registry
from megatron_iso.cli.gate import main
from megatron_iso.contract import write_lock
from megatron_iso.settings import contract_for

FAKES = "tests.bench.gate_fakes"


@pytest.fixture(autouse=True)
def fake_registry() -> Iterator[None]:
    """Registry holding only the fake op; the real one is restored after."""
    from tests.bench import gate_fakes

    saved = dict(registry._REGISTRY)
    registry._REGISTRY.clear()
    gate_fakes.register_fakes()
    try:
        yield
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)


def gate(*args: str) -> int:
    base = ["--op", "gate_fake", "--ops", FAKES, "--inputs", f"{FAKES}:inputs", "--runs", "7", "--warmup", "1"]
    return main([*base, *args, "device=cpu"])


def test_faster_identical_candidate_passes(capsys):
    assert gate("--candidate", f"{FAKES}:fast_identical") == 0
    out = capsys.readouterr().out
    assert "benchmark outputs: bitwise identical" in out
    assert "lock: contract and probe digests match" in out
    assert out.strip().endswith("gate: PASS")


def test_slower_candidate_fails_with_exit_1(capsys):
    assert gate("--candidate", f"{FAKES}:slow_identical") == 1
    assert "NOT FASTER" in capsys.readouterr().out


def test_min_speedup_is_enforced(capsys):
    # ~8x faster by construction, but asked for 1000x.
    assert gate("--candidate", f"{FAKES}:fast_identical", "--min-speedup", "1000") == 1


def test_bit_different_candidate_fails_with_exit_5_and_passes_as_new_policy(capsys, tmp_path):
    assert gate("--candidate", f"{FAKES}:fast_different") == 5
    out = capsys.readouterr().out
    assert "benchmark outputs: DIFFER" in out
    assert "lock: probe gate_fake/out: diverged" in out  # the swap reached the probe
    assert "gate: FAIL (numerics)" in out

    new_lock = tmp_path / "new.lock.json"
    args = ["--candidate", f"{FAKES}:fast_different", "--new-policy", "--candidate-id", "gate_fake.v2@2"]
    assert gate(*args, "--write-lock", str(new_lock)) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("declared new numerical policy:"))
    old, new = line.split(": ", 1)[1].split(" -> ")
    assert len(old) == len(new) == 64 and old != new
    # The new lock is the candidate's policy: it verifies with the candidate swapped in, not without.
    assert gate("--candidate", f"{FAKES}:fast_different", "--lock", str(new_lock)) == 5  # identity differs
    assert "gate_fake.v2@2" in new_lock.read_text()


def test_against_an_existing_lockfile(tmp_path, capsys):
    from megatron_iso.settings.compose import load_config

    lock = tmp_path / "iso.lock.json"
    write_lock(lock, contract_for(load_config(["device=cpu"]), load_implementations=False), ["device=cpu"])
    assert gate("--candidate", f"{FAKES}:fast_identical", "--lock", str(lock)) == 0
    assert gate("--candidate", f"{FAKES}:fast_different", "--lock", str(lock)) == 5


def test_registry_entry_candidate_and_restored_registry(capsys):
    # The performance entry of the same op, as id@version: same function, so not faster (sleep dominates).
    assert gate("--candidate", "gate_fake.performance@1", "--min-speedup", "2") == 1
    assert registry.lookup("gate_fake", "cpu", "correctness").ref == "gate_fake.correctness@1"
    from tests.bench import gate_fakes

    assert gate_fakes.incumbent.__name__ == "incumbent"  # module attribute restored after the swap


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--candidate", "no_such_module:f"], "cannot import"),
        (["--candidate", f"{FAKES}:nope"], "has no attribute"),
        (["--candidate", "missing@1"], "no registry entry"),
        (["--candidate", "justaname"], "expected 'package.module:function'"),
        (["--candidate", f"{FAKES}:fast_identical", "--lock", "/nonexistent/iso.lock.json"], "no such lockfile"),
    ],
)
def test_bad_input_exits_2(args, message, capsys):
    assert gate(*args) == 2
    assert message in capsys.readouterr().err


def test_unknown_op_exits_2(capsys):
    assert main(["--op", "no_such_op", "--candidate", f"{FAKES}:fast_identical", "--ops", FAKES, "device=cpu"]) == 2
    assert "no implementation of op 'no_such_op'" in capsys.readouterr().err
