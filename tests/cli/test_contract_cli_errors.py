"""iso-contract against bad input: exit 2 and one line, apart from 1 (contracts differ)."""

from __future__ import annotations

import pytest

from megatron_iso.cli.contract import main
from megatron_iso.cli.exit_codes import EXIT_NO, EXIT_OK, EXIT_USAGE


@pytest.fixture(scope="module")
def lock(tmp_path_factory):
    path = tmp_path_factory.mktemp("lock") / "iso.lock.json"
    assert main(["lock", "--out", str(path), "device=cpu"]) == EXIT_OK
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["digest", "device=cpu", "profile.leaves=3"], "profile.leaves=3 must be a power of two"),
        (["digest", "device=cpu", "parallel.tp=0"], "parallel.tp=0 is not allowed; allowed values: integers >= 1"),
        (["digest", "model=nope"], "Could not find 'model/nope'"),
        (["digest", "device=tpu"], "device='tpu' is not allowed"),
        (["show", "device=cpu", "rl.nosuchkey=1"], "Could not override 'rl.nosuchkey'"),
    ],
)
def test_bad_config_is_a_usage_error(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_garbage_and_missing_files_are_usage_errors_not_differences(tmp_path, lock, capsys):
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert main(["diff", str(garbage), str(lock)]) == EXIT_USAGE
    assert main(["diff", str(tmp_path / "missing.json"), str(lock)]) == EXIT_USAGE
    assert main(["verify", "--lock", str(garbage)]) == EXIT_USAGE
    assert all(line.startswith("iso-contract") for line in capsys.readouterr().err.strip().splitlines())


def test_differing_contracts_are_the_outcome_code(tmp_path, lock):
    other = tmp_path / "other.lock.json"
    assert main(["lock", "--out", str(other), "device=cpu", "profile.leaves=16"]) == EXIT_OK
    assert main(["diff", str(lock), str(other)]) == EXIT_NO
    assert main(["diff", str(lock), str(lock)]) == EXIT_OK
