"""`iso-contract` subcommands, in process (main(argv)) and in fresh interpreters."""

from __future__ import annotations

import json

import pytest

from megatron_iso.cli.contract import main
from tests.contract.conftest import FAKE_OPS, run_cli

OPS = ["--ops", FAKE_OPS]


@pytest.fixture
def cli(fake_registry, capsys):
    def run(*argv: str) -> tuple[int, str, str]:
        code = main([*argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_show_and_digest_agree(cli):
    code, out, _ = cli("show", *OPS, "device=cpu")
    assert code == 0
    shown = json.loads(out)
    code, out, _ = cli("digest", "device=cpu", *OPS)
    assert code == 0
    digest = json.loads(out)
    assert set(digest) == {"semantic", "numerical_policy", "deployment"}
    assert shown["identities"] == digest
    assert shown["numerical_policy"]["profile"] == "correctness"


def test_overrides_reach_the_contract(cli):
    _, out, _ = cli(
        "show", *OPS, "device=cpu", "model=tiny_moe", "profile=performance", "parallel.tp=2", "parallel.ep=2",
        "parallel.sp=true",
    )  # fmt: skip
    axes = json.loads(out)["numerical_policy"]["claims"]["axes"]
    assert (axes["tp"]["value"], axes["ep"]["value"], axes["sp"]["value"]) == (2, 2, True)


def test_invalid_config_exits_2_with_field(cli):
    code, _, err = cli("digest", *OPS, "device=cpu", "parallel.tp=3")
    assert code == 2
    assert "parallel.tp=3 does not divide model.num_attention_heads=8" in err and "allowed values: [1, 2, 4]" in err
    code, _, err = cli("digest", *OPS, "profile=nope")
    assert code == 2 and "correctness" in err


def _write(cli, path, *overrides) -> None:
    code, out, _ = cli("show", *OPS, "device=cpu", *overrides)
    assert code == 0
    path.write_text(out)


def test_diff(cli, tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    _write(cli, a)
    _write(cli, b, "parallel.tp=4")
    _write(cli, c, "profile.leaves=16")
    code, out, err = cli("diff", str(a), str(b))
    assert code == 0 and "deployment.parallel.tp: 1 != 4" in out and "deployment differs" in err
    code, out, err = cli("diff", str(a), str(c))
    assert code == 1
    assert out.splitlines() == ["numerical_policy.constants.leaves: 8 != 16"]
    assert "numerical_policy differs" in err
    # tampered file: exit 2, never compared
    d = json.loads(c.read_text())
    d["numerical_policy"]["constants"]["leaves"] = 8
    c.write_text(json.dumps(d))
    code, _, err = cli("diff", str(a), str(c))
    assert code == 2 and "does not match the content" in err


def test_lock_and_verify_in_process(cli, tmp_path):
    lock = tmp_path / "iso.lock.json"
    code, out, _ = cli("lock", *OPS, "device=cpu", "--out", str(lock), "parallel.tp=2")  # overrides on both sides
    assert code == 0 and "4 probe digests" in out
    assert json.loads(lock.read_text())["overrides"] == ["device=cpu", "parallel.tp=2"]
    code, out, _ = cli("verify", "--lock", str(lock), *OPS)
    assert code == 0 and "4 probe digests match" in out
    code, out, err = cli("verify", "--lock", str(lock), *OPS, "device=cpu", "profile.gdn_chunk=128")
    assert code == 1 and "numerical_policy.constants.gdn_chunk" in out and "FAILED" in err
    # a lock may be diffed like a contract
    code, _, _ = cli("diff", str(lock), str(lock))
    assert code == 0


def test_verify_rejects_corrupted_lock(cli, tmp_path):
    lock = tmp_path / "iso.lock.json"
    cli("lock", *OPS, "device=cpu", "--out", str(lock))
    lock.write_text(lock.read_text().replace('"tile_m":64', '"tile_m":32'))
    code, _, err = cli("verify", "--lock", str(lock), *OPS)
    assert code == 2 and "self_digest mismatch" in err


def test_unknown_option_is_an_argparse_error(cli):
    with pytest.raises(SystemExit) as info:
        cli("digest", "--bogus")
    assert info.value.code == 2


@pytest.mark.slow
def test_fresh_processes_agree_and_catch_a_changed_kernel(tmp_path):
    """Digests equal across interpreters and hash seeds; a one-ulp kernel change fails verify in a new process."""
    lock = tmp_path / "iso.lock.json"
    r1 = run_cli("lock", *OPS, "device=cpu", "--out", str(lock), env={"PYTHONHASHSEED": "1"})
    assert r1.returncode == 0, r1.stderr
    r2 = run_cli("digest", *OPS, "device=cpu", env={"PYTHONHASHSEED": "2"})
    r3 = run_cli("digest", *OPS, "device=cpu", env={"PYTHONHASHSEED": "random"})
    assert r2.returncode == 0 and r3.returncode == 0, r2.stderr + r3.stderr
    assert json.loads(r2.stdout) == json.loads(r3.stdout)
    assert json.loads(r2.stdout) == json.loads(lock.read_text())["contract"]["identities"]

    ok = run_cli("verify", "--lock", str(lock), *OPS, env={"PYTHONHASHSEED": "3"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = run_cli("verify", "--lock", str(lock), *OPS, env={"ISO_FAKE_PERTURB": "1"})
    assert bad.returncode == 1
    assert "probe fake_gemm/trainer_forward: diverged" in bad.stdout
    assert "fake_gemm/decode: diverged" in bad.stdout
    assert "fake_attention" not in bad.stdout
