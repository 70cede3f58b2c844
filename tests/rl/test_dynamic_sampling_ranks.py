"""Dynamic sampling (DAPO) with data parallelism: ranks keep different numbers of samples, or none.

Every rank must run the same number of forward/backward passes (expert all-to-all), the gradient sync and
the optimizer step. A rank that kept fewer micro-batches runs filler passes whose loss is scaled by 0
(``Trainer.micro_batch_count``, ``Trainer.train_on``). Before that, a rank whose dynamic sampling kept
nothing skipped ``train_on`` and the other ranks waited for it in the gradient all-reduce until the run's
timeout: the two-rank test below then fails by that timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_iso.parallel.world import seed_ranks
from megatron_iso.rl.losses import group_advantages
from megatron_iso.rl.trainer import Trainer
from megatron_iso.settings import config_world, resolve
from megatron_iso.settings.compose import load_config
from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

GROUP = 4
# One generation batch per step (no re-sampling): the ranks keep what the patched filter says.
FAST = [f"rl.group_size={GROUP}", "rl.max_response_length=5", "task.prompts_per_step=6", "model=tiny_dense",
        "rl.max_gen_batches=1"]  # fmt: skip


def _uneven_steps(out_dir: str, rank1_keeps: int, overrides: list[str]) -> dict:
    """Two RL steps where rank 0 keeps every group and rank 1 its first ``rank1_keeps`` groups."""
    import megatron_iso.rl.dynamic_sampling as dynamic_sampling
    import megatron_iso.rl.trainer as trainer_module

    rank = dist.get_rank()
    passes_seen: list[int] = []

    def keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        groups = rewards.numel() // group_size
        return torch.arange(groups) < (groups if rank == 0 else rank1_keeps)

    count = trainer_module.Trainer.micro_batch_count

    def counted(self, n):
        passes_seen.append(count(self, n))
        return passes_seen[-1]

    dynamic_sampling.informative_groups = keep
    trainer_module.Trainer.micro_batch_count = counted
    cfg = load_config([*FAST, "rl=dapo", f"out_dir={out_dir}", *overrides])
    with config_world(cfg) as r:
        seed_ranks(int(cfg.seed))
        trainer = Trainer(resolve(cfg), r)
        rows = [trainer.step(i) for i in range(2)]
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"rows": rows, "params": params, "passes": passes_seen}


@pytest.mark.parametrize(
    ("rank1_keeps", "micro", "ep"),
    [(0, "null", 1), (1, "5", 1), (0, "5", 2)],
    ids=["rank1_none", "rank1_fewer_mb", "moe_ep2_rank1_none"],
)
def test_data_parallel_ranks_keeping_different_counts_stay_in_step(tmp_path, rank1_keeps, micro, ep):
    """With EP=2 (tiny_moe) every pass's expert all-to-all needs both ranks: the filler passes carry rank 1."""
    overrides = [f"rl.train_micro_batch_seqs={micro}"]
    if ep > 1:
        overrides += ["model=tiny_moe", f"parallel.ep={ep}"]
    res = run_on_ranks(_uneven_steps, 2, ep=ep, args=(str(tmp_path / "run"), rank1_keeps, overrides), timeout=420)
    # 3 prompts a rank x 4 samples: rank 0 keeps 12 (1 pass, or 3 of 5), rank 1 keeps 4 * rank1_keeps.
    want = 1 if micro == "null" else 3
    assert res[0]["passes"] == res[1]["passes"] == [want, want]
    for row in res[1]["rows"]:
        assert row["samples/kept_frac"] == rank1_keeps / 3
    for row in res[0]["rows"]:
        assert row["samples/kept_frac"] == 1.0 and row["grad_norm"] > 0
        assert row["mismatch/abs_diff_max"] == 0.0
    # The replicas took the same optimizer steps: their parameters are the same bits (with EP each rank holds
    # its own experts under the same local names: those are not replicas).
    shared = [n for n in res[0]["params"] if ep == 1 or ".experts." not in n]
    assert len(shared) > 4
    for n in shared:
        assert torch.equal(bits(res[1]["params"][n]), bits(res[0]["params"][n])), n


def test_filler_passes_add_exact_zeros(tmp_path):
    """Passes beyond a rank's own micro-batches change nothing: same logprobs, statistics and parameters."""
    base = [*FAST, "task.prompts_per_step=3", "rl.train_micro_batch_seqs=5", f"out_dir={tmp_path / 'run'}"]
    cfg = load_config(base)
    outs, params = [], []
    with config_world(cfg) as rank:
        samples = advantages = None
        for extra in (0, 2):
            seed_ranks(int(cfg.seed))
            trainer = Trainer(resolve(cfg), rank)
            if samples is None:
                samples = trainer.rollout(0)
                trainer.score_rewards(samples)
                advantages = group_advantages(torch.tensor([s.reward for s in samples]), GROUP)
            passes = trainer.micro_batch_count(len(samples))
            assert passes == 3  # 12 samples in micro-batches of 5
            outs.append(trainer.train_on(samples, advantages, micro_batches=passes + extra, filler=samples[-1]))
            params.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        with pytest.raises(ValueError, match="micro_batches=2 < the 3"):
            trainer.train_on(samples, advantages, micro_batches=2)
        with pytest.raises(ValueError, match="filler sample"):
            trainer.train_on(samples, advantages, micro_batches=4)
    for key in ("trainer_logp", "rollout_logp"):
        assert torch.equal(bits(outs[0][key]), bits(outs[1][key])), key
    for key in ("loss", "grad_norm", "policy/clip_frac"):
        assert torch.equal(bits(outs[0][key]), bits(outs[1][key])), key
    for n, p in params[0].items():
        assert torch.equal(bits(params[1][n]), bits(p)), n
