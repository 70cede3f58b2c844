"""rl.train_micro_batch_seqs: one optimizer step over the samples in micro-batches.

The iso forward is batch invariant, so every micro-batch size gives the same trainer logprobs bit for
bit, and the loss is normalised over the whole step, so the loss, its statistics and the per-token
loss gradients are the one-batch ones too (tests/rl/test_losses.py). What differs is the sum order of the weight gradients
(sum over micro-batches of X_j^T dY_j against one X^T dY: plain fp32 matmuls in backward, which
the design keeps deterministic, not invariant).
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.parallel.world import seed_ranks
from megatron_iso.rl import trainer as trainer_module
from megatron_iso.rl.losses import group_advantages
from megatron_iso.rl.run import TIMING_PREFIXES, train
from megatron_iso.rl.trainer import Trainer
from megatron_iso.settings import check_micro_batch_seqs, config_world, resolve
from megatron_iso.settings.compose import load_config
from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

GROUP = 4
# 3 prompts x 4 samples = 12 sequences: micro-batches of 5 leave a short last one.
FAST = [f"rl.group_size={GROUP}", "rl.max_response_length=5", "task.prompts_per_step=3"]
SAMPLES = 12
# fp32 ulps of a tensor's largest |grad| that reassociating its token sum may move an element by
# (measured on tiny_dense: at most 4.9).
GRAD_ULPS = 16


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()}


def _steps(tmp_path, overrides: list[str], sizes: list[int | None], monkeypatch=None, swap_grads=False) -> dict:
    """One train_on per micro-batch size, each on a fresh trainer (same seed, same weights) and the
    same samples. With ``swap_grads``, every run after the first records its accumulated grads and
    then continues from the first run's, so the step after them can be compared bit for bit."""
    base = [*FAST, f"out_dir={tmp_path / 'run'}", *overrides]
    runs: dict = {}
    real_finalize = trainer_module.finalize_model_grads
    cfg = load_config(base)
    with config_world(cfg) as rank:
        samples = advantages = None
        for size in sizes:
            seed_ranks(int(cfg.seed))
            trainer = Trainer(
                resolve(load_config([*base, f"rl.train_micro_batch_seqs={'null' if size is None else size}"])), rank
            )
            if samples is None:
                samples = trainer.rollout(0)
                trainer.score_rewards(samples)
                advantages = group_advantages(torch.tensor([s.reward for s in samples]), GROUP)
            accumulated = {}

            def finalize(models, *args, trainer=trainer, accumulated=accumulated, **kwargs):
                accumulated.update(_grads(trainer))
                if swap_grads and runs:
                    first = next(iter(runs.values()))["grads"]
                    for n, p in trainer.model.named_parameters():
                        p.main_grad.copy_(first[n])
                return real_finalize(models, *args, **kwargs)

            if monkeypatch is not None:
                monkeypatch.setattr(trainer_module, "finalize_model_grads", finalize)  # as the trainer calls it
            out = trainer.train_on(samples, advantages)
            params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            runs[size] = {"out": out, "grads": accumulated, "params": params}
    assert len(samples) == SAMPLES
    return runs


def _assert_same_step_results(a: dict, b: dict) -> None:
    """Logprobs, loss, statistics and (given the same grads) grad norm: bit for bit."""
    for key in ("trainer_logp", "rollout_logp"):
        assert torch.equal(bits(a[key]), bits(b[key])), key

    def scalars(out: dict) -> dict:
        return {k: v for k, v in out.items() if isinstance(v, float) and not k.startswith("timing/")}

    assert {"loss", "grad_norm", "policy/clip_frac"} <= scalars(a).keys() == scalars(b).keys()
    for k, v in scalars(a).items():
        assert torch.equal(bits(v), bits(b[k])), (k, v, b[k])


def test_micro_batches_give_the_one_batch_logprobs_bit_for_bit(tmp_path):
    runs = _steps(tmp_path, ["model=tiny_hybrid", "profile.gdn_chunk=4"], [None, 1, 5])
    one = runs[None]["out"]
    assert torch.equal(bits(one["trainer_logp"]), bits(one["rollout_logp"]))  # iso: trainer == rollout
    for size in (1, 5):
        assert torch.equal(bits(runs[size]["out"]["trainer_logp"]), bits(one["trainer_logp"]))


@pytest.mark.parametrize(
    "overrides",
    [[], ["rl.aggregation=token_mean", "rl.kl_coef=0.1", "rl.tis_cap=2.0"]],
    ids=["seq_mean", "token_mean_kl_tis"],
)
def test_micro_batches_change_only_the_weight_grad_sum_order(tmp_path, monkeypatch, overrides):
    # 0 and anything >= the sample count are one batch: the same computation, so the same bits.
    runs = _steps(tmp_path, ["model=tiny_dense", *overrides], [0, SAMPLES, SAMPLES + 3], monkeypatch)
    first = runs[0]
    for size in (SAMPLES, SAMPLES + 3):
        _assert_same_step_results(first["out"], runs[size]["out"])
        for n, p in first["params"].items():
            assert torch.equal(bits(runs[size]["params"][n]), bits(p)), n

    runs = _steps(tmp_path, ["model=tiny_dense", *overrides], [0, 1, 2, 5], monkeypatch, swap_grads=True)
    first = runs[0]
    if overrides:
        assert {"kl/ref_k3", "rollout_correction/weight_mean"} <= first["out"].keys()
    for size in (1, 2, 5):
        run = runs[size]
        _assert_same_step_results(first["out"], run["out"])
        # The accumulated grads: within a few ulps of each tensor's scale, i.e. one sum reassociated.
        # (Comparing parameters directly would need a loose tolerance: Adam's first update is
        # lr * g / (|g| + eps), so for |g| near eps = 1e-8 it magnifies those ulps up to lr / eps.)
        for n, g in first["grads"].items():
            bound = GRAD_ULPS * torch.finfo(torch.float32).eps * float(g.abs().max())
            assert float((run["grads"][n] - g).abs().max()) <= bound, n
        # Given the one-batch grads, the rest of the step (finalize, clip, Adam) is the same bits.
        for n, p in first["params"].items():
            assert torch.equal(bits(run["params"][n]), bits(p)), n


@pytest.mark.parametrize("value", ["-1", "1.5", "all", "true"])
def test_bad_micro_batch_size_names_the_field(tmp_path, value):
    cfg = load_config([*FAST, f"out_dir={tmp_path / 'bad'}", f"rl.train_micro_batch_seqs={value}"])
    with pytest.raises(ValueError, match=r"rl.train_micro_batch_seqs=.*allowed values: 0 or null .* positive integer"):
        check_micro_batch_seqs(cfg.rl.get("train_micro_batch_seqs"))
    with pytest.raises(ValueError, match="rl.train_micro_batch_seqs"):
        train(cfg)
    assert not (tmp_path / "bad").exists()


def _history(out_dir: str, overrides: list[str]) -> list[dict]:
    return train(load_config([*FAST, "rl.steps=2", f"out_dir={out_dir}", *overrides]))["history"]


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sp=true"], []], ids=["tp2_sp", "dp2"])
def test_micro_batches_on_two_ranks(tmp_path, layout):
    """SP pads each micro-batch on its own; TP grads are finalised and DP grads synced once, after the
    last micro-batch. Step 0 (same weights, same samples) logs the one-batch run's numbers bit for bit."""
    tp = 2 if layout else 1
    micro = run_on_ranks(_history, 2, tp=tp, args=(str(tmp_path / "micro"), [*layout, "rl.train_micro_batch_seqs=5"]))
    whole = run_on_ranks(_history, 2, tp=tp, args=(str(tmp_path / "whole"), layout))
    for rank, rows in enumerate(micro):
        assert all(r["mismatch/abs_diff_max"] == 0.0 and r["mismatch/bitwise_equal_frac"] == 1.0 for r in rows)
        step0 = {k: v for k, v in rows[0].items() if not k.startswith((*TIMING_PREFIXES, "grad_norm"))}
        assert step0.keys() >= {"loss", "policy/clip_frac", "reward/mean", "mismatch/abs_diff_max"}
        assert step0 == {k: v for k, v in whole[rank][0].items() if k in step0}, rank  # loss: this rank's samples
