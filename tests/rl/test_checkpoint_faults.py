"""Run checkpoints under faults: non-finite weights are never written, damaged files are named, a save cut short
leaves the previous checkpoint usable, old checkpoints are pruned, the per-rank format is refused by name.

One process, a tiny Megatron model and Megatron's optimizer (the checkpoint is their sharded state dicts)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_iso.errors import NonFiniteError, UserError
from megatron_iso.rl.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from megatron_iso.testing.bits import bits


@pytest.fixture(scope="module")
def world():
    from megatron_iso.parallel.world import single_process_world

    with single_process_world():
        yield


def _model(seed: int = 0, *overrides: str, trained: bool = True):
    """A tiny dense policy and its optimizer; ``trained``: after one Adam step on random gradients (Adam state set)."""
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.rl.optim import build_optimizer
    from megatron_iso.settings import resolve
    from megatron_iso.settings.compose import load_config

    cfg = load_config(["model=tiny_dense", *overrides])
    tc = transformer_config(cfg)
    model = build_model(tc, random_hf_state_dict(tc, seed=seed))
    ddp, optimizer, _ = build_optimizer(tc, model, resolve(cfg).rl)
    if trained:
        gen = torch.Generator().manual_seed(seed)
        ddp.zero_grad_buffer()
        for p in model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        optimizer.step()
    return model, optimizer


def _save(run, step, model, opt, **kw):
    return save_checkpoint(run, step, model, opt, {"numerical_policy": "p"}, rank=0, **kw)


def _load(path, model, opt):
    return load_checkpoint(path, model, opt, {"numerical_policy": "p"}, rank=0)


def _same(model_a, opt_a, model_b, opt_b) -> None:
    for (n, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters(), strict=True):
        assert torch.equal(bits(a.detach()), bits(b.detach())), n
    states_a, states_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert states_a.keys() == states_b.keys()
    for i in states_a:
        for key, t in states_a[i].items():
            assert torch.equal(bits(t), bits(states_b[i][key])), (i, key)


def _shard_files(path):
    return sorted(path.glob("*.distcp"))


def test_nan_weights_are_never_saved(world, tmp_path):
    model, opt = _model()
    _save(tmp_path, 0, model, opt)
    with torch.no_grad():
        model.decoder.final_layernorm.weight[2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"refusing to write checkpoint .*step_000001: NaN or Inf in decoder"):
        _save(tmp_path, 1, model, opt)
    assert latest_checkpoint(tmp_path).name == "step_000000"
    assert not (tmp_path / "checkpoints" / "step_000001").exists()


def test_a_clean_round_trip_restores_weights_and_adam_state(world, tmp_path):
    model, opt = _model(0)
    path = _save(tmp_path, 0, model, opt)
    fresh, fresh_opt = _model(1, trained=False)
    meta = _load(path, fresh, fresh_opt)
    assert meta["step"] == 0 and meta["numerical_policy"] == "p"
    _same(model, opt, fresh, fresh_opt)


def test_a_truncated_shard_file_is_named_with_the_previous_checkpoint(world, tmp_path):
    model, opt = _model()
    _save(tmp_path, 0, model, opt)
    path = _save(tmp_path, 1, model, opt)
    shard = _shard_files(path)[0]
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(CheckpointError) as err:
        _load(path, *_model(trained=False))
    message = str(err.value)
    assert str(path) in message and "step_000000" in message and "\n" not in message
    assert isinstance(err.value, UserError)


def test_a_damaged_first_checkpoint_says_there_is_no_earlier_one(world, tmp_path):
    model, opt = _model()
    path = _save(tmp_path, 0, model, opt)
    (path / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"step_000000/\.metadata is not the file saved.*no earlier complete"):
        _load(path, *_model(trained=False))


def test_nan_in_a_checkpoint_is_refused_on_load(world, tmp_path, monkeypatch):
    import megatron_iso.rl.checkpoint as ckpt

    model, opt = _model()
    with torch.no_grad():
        model.output_layer.weight[0, 0] = float("inf")
    monkeypatch.setattr(ckpt, "check_finite", lambda *a, **k: None)  # a file damaged after it was written
    path = _save(tmp_path, 0, model, opt)
    monkeypatch.undo()
    with pytest.raises(NonFiniteError, match="NaN or Inf in output_layer.weight"):
        _load(path, *_model(trained=False))


def test_a_shape_change_is_named(world, tmp_path):
    path = _save(tmp_path, 0, *_model())
    with pytest.raises(CheckpointError, match=r"linear_fc2.weight \[2, 64, 128\] \(model \[2, 64, 96\]\)"):
        _load(path, *_model(0, "model.ffn_hidden_size=96", trained=False))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_save_cut_short_leaves_the_previous_checkpoint_usable(world, tmp_path, monkeypatch, when):
    """An error (or a kill) during a save, before or after its shard files are written: nothing is published, the
    previous checkpoint stays the latest and loads with its bits, and the next save succeeds."""
    from megatron.core import dist_checkpointing

    model, opt = _model(0)
    first = _save(tmp_path, 0, model, opt)
    real = dist_checkpointing.save

    def cut(state, directory, **kw):
        if when == "after":
            real(state, directory, **kw)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(dist_checkpointing, "save", cut)
    moved, moved_opt = _model(5)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 1, moved, moved_opt)
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / "step_000001.tmp").is_dir()  # the remains, never picked
    assert latest_checkpoint(tmp_path) == first and complete_checkpoints(tmp_path) == [first]
    fresh, fresh_opt = _model(1, trained=False)
    _load(first, fresh, fresh_opt)
    _same(model, opt, fresh, fresh_opt)
    assert _save(tmp_path, 1, moved, moved_opt).name == "step_000001"
    assert not (tmp_path / "checkpoints" / "step_000001.tmp").exists()


def test_keep_checkpoints_prunes_all_but_the_newest(world, tmp_path):
    model, opt = _model()
    for step in range(4):
        _save(tmp_path, step, model, opt, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path).name == "step_000003"
    _save(tmp_path, 4, model, opt)  # keep=None: all kept
    assert len(complete_checkpoints(tmp_path)) == 3
    # `latest` is never removed, even when it is not the newest (a run rewound to an older checkpoint).
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step_000003"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000004"]


@pytest.mark.parametrize(("value", "kept"), [(3, 3), (0, 0), (None, 0)])
def test_keep_checkpoints_setting(value, kept):
    from megatron_iso.settings import resolve
    from megatron_iso.settings.compose import load_config

    assert (
        resolve(load_config([f"rl.keep_checkpoints={'null' if value is None else value}"])).rl.keep_checkpoints == kept
    )


def test_keep_checkpoints_refuses_a_negative_count():
    from megatron_iso.settings import resolve
    from megatron_iso.settings.compose import load_config
    from megatron_iso.settings.fields import SettingsError

    with pytest.raises(SettingsError, match=r"rl.keep_checkpoints=-1 is not allowed; allowed values: integers >= 0"):
        resolve(load_config(["rl.keep_checkpoints=-1"]))


def test_the_per_rank_format_is_refused_by_name(world, tmp_path):
    old = tmp_path / "checkpoints" / "step_000000"
    old.mkdir(parents=True)
    (old / "meta.json").write_text(json.dumps({"step": 0, "tp": 1, "world_size": 1}))
    (old / "model_rank0.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"per-rank format \(model_rank<r>.safetensors .*iso-convert export"):
        _load(old, *_model(trained=False))


def _as_written_before_checksums(path) -> None:
    """What a checkpoint of an earlier version looks like: no checksums.json, and meta.json declares none."""
    (path / "checksums.json").unlink()
    meta = json.loads((path / "meta.json").read_text())
    del meta["checksums"]
    (path / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_from_before_checksums_loads_with_a_one_line_warning(world, tmp_path, capsys):
    model, opt = _model(0)
    path = _save(tmp_path, 0, model, opt)
    _as_written_before_checksums(path)
    assert complete_checkpoints(tmp_path) == [path]
    capsys.readouterr()
    fresh, fresh_opt = _model(1, trained=False)
    _load(path, fresh, fresh_opt)
    _same(model, opt, fresh, fresh_opt)
    err = capsys.readouterr().err
    assert (
        err
        == f"warning: {path} has no checksums.json (saved by an earlier megatron_iso version): loaded without verifying its files\n"
    )


def test_a_checkpoint_missing_its_declared_checksums_is_refused(world, tmp_path):
    model, opt = _model()
    first = _save(tmp_path, 0, model, opt)
    path = _save(tmp_path, 1, model, opt)
    (path / "checksums.json").unlink()
    assert complete_checkpoints(tmp_path) == [first]  # not complete: never offered, never pruned as one
    with pytest.raises(
        CheckpointError, match=r"says the checkpoint was saved with checksums\.json, which is missing.*step_000000"
    ):
        _load(path, *_model(trained=False))


def test_every_file_is_recorded_and_a_missing_one_is_named(world, tmp_path):
    path = _save(tmp_path, 0, *_model())
    recorded = json.loads((path / "checksums.json").read_text())["files"]
    assert sorted(recorded) == sorted(p.name for p in path.iterdir() if p.name != "checksums.json")
    assert "meta.json" in recorded and all(len(v["sha256"]) == 64 for v in recorded.values())
    (path / "common.pt").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"common\.pt is not the file saved: expected SHA-256 \w{64} \(\d+ bytes\), the file is missing",
    ):
        _load(path, *_model(trained=False))
