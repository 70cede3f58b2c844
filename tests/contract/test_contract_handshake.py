"""Start-up handshake: file rendezvous and torch.distributed, refusing with the first differing field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from megatron_iso.contract import ContractFormatError, ContractMismatchError, handshake
from tests.contract.conftest import contract_of

pytestmark = pytest.mark.usefixtures("fake_registry")


def test_file_handshake_matching_pair(cfg_for, tmp_path):
    trainer = contract_of(cfg_for("parallel.tp=4", "parallel.dp=2"))
    rollout = contract_of(cfg_for())  # a different, neutral layout
    first = handshake(trainer, path=tmp_path, role="trainer")
    assert first.peers == {}
    res = handshake(rollout, path=tmp_path, role="rollout", expect=("trainer",), timeout_s=5)
    assert set(res.peers) == {"trainer"}
    assert res.peers["trainer"]["deployment"]["parallel"]["tp"] == 4  # exchanged for the log
    # the trainer, re-checking, now sees the rollout too
    assert set(handshake(trainer, path=tmp_path, role="trainer", expect=("rollout",)).peers) == {"rollout"}


@pytest.mark.parametrize(
    ("override", "field", "local", "remote"),
    [
        ("profile.leaves=16", "numerical_policy.constants.leaves", 8, 16),
        ("profile.gdn_chunk=32", "numerical_policy.constants.gdn_chunk", 64, 32),
        ("device=cuda", "numerical_policy.composition.fake_attention.decode.device_class", "cpu", "cuda"),
        ("model.num_layers=3", "semantic.architecture.num_layers", 2, 3),
    ],
)
def test_file_handshake_mismatch_names_field(cfg_for, tmp_path, override, field, local, remote):
    handshake(contract_of(cfg_for(override)), path=tmp_path, role="trainer")
    with pytest.raises(ContractMismatchError) as info:
        handshake(contract_of(cfg_for()), path=tmp_path, role="rollout", expect=("trainer",), timeout_s=5)
    err = info.value
    assert (err.field, err.local, err.remote) == (field, local, remote)
    assert field in str(err) and "'trainer'" in str(err) and "refusing to start" in str(err)


def test_profile_mismatch_reports_first_policy_field(cfg_for, tmp_path):
    handshake(contract_of(cfg_for("profile=performance")), path=tmp_path, role="trainer")
    with pytest.raises(ContractMismatchError) as info:
        handshake(contract_of(cfg_for()), path=tmp_path, role="rollout")
    assert info.value.field.startswith("numerical_policy.")
    assert len(info.value.diffs) > 3


def test_file_handshake_times_out_naming_missing_peer(cfg_for, tmp_path):
    with pytest.raises(TimeoutError, match=r"no contract from \['rollout'\]"):
        handshake(contract_of(cfg_for()), path=tmp_path, role="trainer", expect=("rollout",), timeout_s=0.3)


def test_file_handshake_rejects_tampered_peer(cfg_for, tmp_path):
    handshake(contract_of(cfg_for()), path=tmp_path, role="trainer")
    f = tmp_path / "trainer.contract.json"
    d = json.loads(f.read_text())
    d["numerical_policy"]["constants"]["leaves"] = 4  # forged to look compatible with someone
    f.write_text(json.dumps(d))
    with pytest.raises(ContractFormatError, match=r"identities\.numerical_policy"):
        handshake(contract_of(cfg_for()), path=tmp_path, role="rollout")


def test_handshake_without_process_group_explains(cfg_for):
    with pytest.raises(RuntimeError, match="initialized process group"):
        handshake(contract_of(cfg_for()))


def _dist_worker(rank: int, world: int, init_file: str, out_dir: str, chunks: list[int]) -> None:
    import torch.distributed as dist

    from megatron_iso.contract import ContractMismatchError, handshake
    from megatron_iso.settings.compose import load_config
    from tests.contract import iso_fake_ops  # noqa: F401  (registers the fakes in this fresh process)

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = load_config(["device=cpu", f"profile.gdn_chunk={chunks[rank]}", f"parallel.tp={2**rank}"])
        try:
            handshake(contract_of(cfg))
            result = {"ok": True}
        except ContractMismatchError as exc:
            result = {"ok": False, "field": exc.field, "local": exc.local, "remote": exc.remote, "peer": exc.peer}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, chunks: list[int]) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir(parents=True)
    # spawned children re-import this module; make the repo root importable for them
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    n = len(chunks)
    mp.spawn(_dist_worker, args=(n, str(tmp_path / "init"), str(out), chunks), nprocs=n, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.slow
def test_distributed_handshake_gloo(tmp_path):
    # ranks 0 and 1 differ only in TP (neutral), rank 2 in the GDN chunk: every rank must refuse,
    # and rank 0 must get past rank 1 (checked first) to name rank 2.
    res = _spawn(tmp_path, [64, 64, 32])
    field = "numerical_policy.constants.gdn_chunk"
    assert res[0] == {"ok": False, "field": field, "local": 64, "remote": 32, "peer": "rank 2"}
    assert res[1] == {"ok": False, "field": field, "local": 64, "remote": 32, "peer": "rank 2"}
    assert res[2] == {"ok": False, "field": field, "local": 32, "remote": 64, "peer": "rank 0"}


@pytest.mark.slow
def test_distributed_handshake_gloo_neutral_layouts_pass(tmp_path):
    assert _spawn(tmp_path, [64, 64]) == [{"ok": True}, {"ok": True}]
