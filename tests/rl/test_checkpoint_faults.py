"""Run checkpoints under faults: non-finite weights are never written, damaged files are named."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_iso.errors import NonFiniteError, UserError
from megatron_iso.rl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def _model(width: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _save(run, step, model, opt):
    return save_checkpoint(run, step, model, opt, {"tp": 1}, rank=0)


def test_nan_weights_are_never_saved(tmp_path):
    model, opt = _model()
    _save(tmp_path, 0, model, opt)
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"refusing to write checkpoint .*step_000001: NaN or Inf in weight"):
        _save(tmp_path, 1, model, opt)
    assert latest_checkpoint(tmp_path).name == "step_000000"
    assert not (tmp_path / "checkpoints" / "step_000001").exists()


def test_a_truncated_weight_file_is_named_with_the_previous_checkpoint(tmp_path):
    model, opt = _model()
    _save(tmp_path, 0, model, opt)
    path = _save(tmp_path, 1, model, opt)
    weights = path / "model_rank0.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, *_model(), {"tp": 1}, rank=0)
    message = str(err.value)
    assert str(weights) in message and "step_000000" in message and "\n" not in message
    assert isinstance(err.value, UserError)


def test_a_damaged_first_checkpoint_says_there_is_no_earlier_one(tmp_path):
    model, opt = _model()
    path = _save(tmp_path, 0, model, opt)
    (path / "optim_rank0.pt").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"optim_rank0\.pt.*no earlier complete checkpoint exists"):
        load_checkpoint(path, *_model(), {"tp": 1}, rank=0)


def test_nan_in_a_checkpoint_file_is_refused_on_load(tmp_path):
    model, opt = _model()
    path = _save(tmp_path, 0, model, opt)
    weights = path / "model_rank0.safetensors"
    state = load_file(str(weights))
    state["bias"][0] = float("inf")
    save_file(state, str(weights))
    with pytest.raises(NonFiniteError, match="NaN or Inf in bias"):
        load_checkpoint(path, *_model(), {"tp": 1}, rank=0)


def test_a_shape_change_is_named(tmp_path):
    model, opt = _model(4)
    path = _save(tmp_path, 0, model, opt)
    with pytest.raises(CheckpointError, match=r"weight \[4, 4\] \(model \[6, 6\]\)"):
        load_checkpoint(path, *_model(6), {"tp": 1}, rank=0)


def test_a_clean_round_trip_restores_the_bits(tmp_path):
    model, opt = _model()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = _save(tmp_path, 0, model, opt)
    fresh, fresh_opt = _model()
    load_checkpoint(path, fresh, fresh_opt, {"tp": 1}, rank=0)
    for (_, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
