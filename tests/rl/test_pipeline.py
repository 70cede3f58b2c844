"""Pipeline parallelism for the trainer (rl.pipeline, Megatron-Core's 1F1B schedule on 2 gloo ranks; PP 2 x TP 2 on 4).

A PP 2 trainer runs the same layers in the same order as PP 1, split over two ranks that hand each other the
hidden states and their gradients through Megatron's p2p communication (batch_isend_irecv works on gloo); its
rollout runs in a layout of its own (PP 1, rollout DP 2) and receives the stages' weights after every step.
Every step's trainer and rollout logprobs, rewards, mismatch, loss and grad norm (the stages' per-tensor norms
joined in the unpipelined order: rl.optim) equal PP 1's bit for bit, and so do the weights. PP 1 runs with the
threads of one PP 2 rank: the CPU's GEMMs sum in an order that depends on the thread count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_iso.rl.run import TIMING_PREFIXES
from megatron_iso.settings import SettingsError
from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

FAST = ["rl.group_size=4", "rl.max_response_length=3", "task.prompts_per_step=2", "logger=none", "rl.steps=3"]


def _run(root: str, overrides: list[str]) -> list[dict]:
    from megatron_iso.parallel.launch import cpu_threads_per_rank
    from megatron_iso.rl import run, trainer
    from megatron_iso.settings.compose import load_config

    # The CPU's fp32 GEMMs (the backward's) sum in an order that depends on the thread count: PP 1 on one rank
    # runs with the threads of one of PP 2's ranks.
    torch.set_num_threads(cpu_threads_per_rank(2))
    steps = []
    train_on = trainer.Trainer.train_on

    def recorded(self, *args, **kwargs):
        out = train_on(self, *args, **kwargs)
        steps.append({k: out[k].clone() for k in ("trainer_logp", "rollout_logp")})
        return out

    trainer.Trainer.train_on = recorded
    run.train(load_config([*FAST, f"out_dir={root}", *overrides]))
    return steps


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint's weights and Adam state under their global names: the same keys whichever stage wrote a
    layer, so a PP 2 checkpoint equal to PP 1's loads at PP 1 as that one does."""
    from megatron_iso.checkpoint.run_ckpt import checkpoint_tensors

    last = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return checkpoint_tensors(last, optimizer=True)


@pytest.mark.parametrize(
    "model",
    [["model=tiny_dense", "rl.train_micro_batch_seqs=3"], ["model=tiny_hybrid", "profile.gdn_chunk=4"]],
    ids=["dense_micro_batches", "hybrid"],
)
def test_pp2_trainer_equals_pp1_bit_for_bit(tmp_path, model):
    one = run_on_ranks(_run, 1, args=(str(tmp_path / "pp1"), model), timeout=600)[0]
    two = run_on_ranks(_run, 2, pp=2, args=(str(tmp_path / "pp2"), [*model, "parallel.pp=2"]), timeout=600)
    assert len(one) == 3
    for stage in two:  # both stages report the last stage's logprobs
        for step, (a, b) in enumerate(zip(one, stage, strict=True)):
            for key in ("trainer_logp", "rollout_logp"):
                assert torch.equal(bits(a[key]), bits(b[key])), (step, key)
    rows1, rows2 = _rows(tmp_path / "pp1"), _rows(tmp_path / "pp2")
    assert rows1[0]["grad_norm"] > 1.0  # rl.grad_clip=1 clips: the clip factor is the same bits too
    for a, b in zip(rows1, rows2, strict=True):
        assert a["mismatch/abs_diff_max"] == b["mismatch/abs_diff_max"] == 0.0
        assert a == b  # loss, grad norm, rewards, mismatch, learning rate: the same numbers
    # The checkpoint records its stages; it holds every layer under its global name, as PP 1's does.
    assert json.loads((tmp_path / "pp2" / "checkpoints" / "step_000002" / "meta.json").read_text())["pp"] == 2
    w1, w2 = _weights(tmp_path / "pp1"), _weights(tmp_path / "pp2")
    assert w1.keys() == w2.keys()
    for n, w in w1.items():
        assert torch.equal(bits(w2[n]), bits(w)), n


def test_pp2_tp2_on_four_ranks_equals_pp1_tp2_bit_for_bit(tmp_path):
    """Stages of TP 2 with sequence parallelism: each stage's TP pair pads, scatters and reduces as PP 1's does, the
    stages hand each other sequence-scattered hidden states, and the grad norm joins the stages' per-tensor norms
    before the TP all-reduce, so it is PP 1's exactly (no tolerance)."""
    model = ["model=tiny_dense", "rl.steps=2", "parallel.tp=2", "parallel.sp=true", "rl.train_micro_batch_seqs=3"]
    one = run_on_ranks(_run, 2, tp=2, args=(str(tmp_path / "pp1"), model), timeout=600)
    four = run_on_ranks(_run, 4, tp=2, pp=2, args=(str(tmp_path / "pp2"), [*model, "parallel.pp=2"]), timeout=600)
    assert len(one[0]) == 2
    for rank, got in enumerate(four):  # Megatron's order puts TP innermost: rank r is TP rank r % 2 of its stage
        for step, (a, b) in enumerate(zip(one[rank % 2], got, strict=True)):
            for key in ("trainer_logp", "rollout_logp"):
                assert torch.equal(bits(a[key]), bits(b[key])), (rank, step, key)
    rows1, rows2 = _rows(tmp_path / "pp1"), _rows(tmp_path / "pp2")
    assert rows1[0]["grad_norm"] > 1.0  # clipped: the clip factor's bits decide step 1
    for a, b in zip(rows1, rows2, strict=True):
        assert a["mismatch/abs_diff_max"] == b["mismatch/abs_diff_max"] == 0.0
        assert a == b  # loss, grad norm, rewards, mismatch, learning rate: the same numbers
    meta = json.loads((tmp_path / "pp2" / "checkpoints" / "step_000001" / "meta.json").read_text())
    assert (meta["tp"], meta["pp"]) == (2, 2)
    w1, w2 = _weights(tmp_path / "pp1"), _weights(tmp_path / "pp2")
    assert w1.keys() == w2.keys()
    for n, w in w1.items():
        assert torch.equal(bits(w2[n]), bits(w)), n


def test_pp2_starts_from_an_hf_checkpoint_as_pp1_does(tmp_path):
    """``model.init_from`` an HF directory: each stage loads its layers of it (models.weights under stage names)."""
    from tests.checkpoint.conftest import make_hf_model

    start = [f"model.init_from={make_hf_model(tmp_path / 'hf', tokenizer=True, seed=3)}", "rl.steps=2"]
    one = run_on_ranks(_run, 1, args=(str(tmp_path / "pp1"), start), timeout=600)[0]
    two = run_on_ranks(_run, 2, pp=2, args=(str(tmp_path / "pp2"), [*start, "parallel.pp=2"]), timeout=600)
    for a, b in zip(one, two[0], strict=True):
        assert torch.equal(bits(a["trainer_logp"]), bits(b["trainer_logp"]))
    assert _rows(tmp_path / "pp1") == _rows(tmp_path / "pp2")


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["parallel.pp=2", "model=tiny_dense", "model.num_layers=3"], "split evenly"),
        (["parallel.pp=2", "model=tiny_dense", "model.tie_word_embeddings=true"], "tie_word_embeddings"),
        (["parallel.pp=2", "model=tiny_dense", "rl.kl_coef=0.1"], "rl.kl_coef=0"),
        (["parallel.pp=2", "model=tiny_dense", "rl.save_hf_every=1"], "rl.save_hf_every=0"),
        (["parallel.pp=2", "model=tiny_dense", "parallel.cp=2"], "parallel.cp=2 with parallel.pp=2"),
    ],
)
def test_unsupported_pipeline_settings_are_refused_by_name(overrides, named):
    from megatron_iso.settings import check_trainable, resolve
    from megatron_iso.settings.compose import load_config

    with pytest.raises(SettingsError, match=named):
        check_trainable(resolve(load_config(overrides)))
