"""Run checkpoints reshard: written at one layout, resumed at another (TP 2 -> TP 1 on one rank, TP 2 -> TP 1 x DP 2
and back, the distributed optimizer DP 2 -> DP 1 and -> TP 2), with the weights and the optimizer state those
saved, bit for bit. A checkpoint stores every tensor whole under its global name, so the proof is to load it at
the other layout, save it again there, and compare the two checkpoints' tensors (model and Adam state) and common
state bit for bit.

The first step after a TP 2 -> TP 1 resume repeats the uninterrupted TP 2 run's step: the same rollout (samples,
rewards, logprobs, mismatch), loss and learning rate, since the forward is TP invariant. Its grad norm, and so
the steps after it, may differ in the last bits: the backward is deterministic, not TP invariant. A DP change
gives each prompt another request id (the sampler's stream is keyed by the DP rank), hence other samples: there
the claim is the state's bits and a zero mismatch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_iso.rl.run import TIMING_PREFIXES
from megatron_iso.settings import resolve
from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

FAST = ["rl.group_size=4", "rl.max_response_length=3", "task.prompts_per_step=2", "logger=none"]
DIST = "rl.use_distributed_optimizer=true"


def _train(out: str, overrides: list[str]) -> list[dict]:
    from megatron_iso.parallel.world import seed_ranks
    from megatron_iso.rl.run import train
    from megatron_iso.settings.compose import load_config

    cfg = load_config([*FAST, f"out_dir={out}", *overrides])
    seed_ranks(int(cfg.seed))
    return train(cfg)["history"]


def _reload(ckpt: str, out: str, overrides: list[str], then_train: list[str] | None = None) -> Any:
    """At this layout: load ``ckpt`` into a fresh trainer, save it again under ``out``; then, optionally, resume a copy
    of the run ``ckpt`` belongs to with ``then_train`` overrides."""
    import torch.distributed as dist

    from megatron_iso.rl.checkpoint import load_checkpoint, save_checkpoint
    from megatron_iso.rl.trainer import Trainer
    from megatron_iso.settings.compose import load_config

    rank = dist.get_rank()
    trainer = Trainer(resolve(load_config([*FAST, f"out_dir={out}/unused", *overrides])), rank)
    meta = load_checkpoint(Path(ckpt), trainer.model, trainer.optimizer, {}, rank=rank)
    save_checkpoint(Path(out), meta["step"], trainer.model, trainer.optimizer, {}, rank=rank)
    return None if then_train is None else _train(str(Path(ckpt).parent.parent), [*overrides, *then_train])


def _same_tree(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _same_checkpoint(a: Path, b: Path) -> None:
    """Every tensor (weights, Adam moments, fp32 main weights) and the common state (param groups, Adam's step)."""
    from megatron_iso.checkpoint.run_ckpt import checkpoint_tensors

    ta, tb = checkpoint_tensors(a, optimizer=True), checkpoint_tensors(b, optimizer=True)
    assert any(k.startswith("optimizer.") for k in ta) and any(not k.startswith("optimizer.") for k in ta)
    _same_tree(ta, tb, str(a))
    common = [torch.load(p / "common.pt", weights_only=True) for p in (a, b)]
    _same_tree(*common, "common.pt")


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def _rewound_copy(run: Path, to: Path, step: int) -> Path:
    """A copy of ``run`` whose latest checkpoint is ``step`` (later ones removed): resuming it repeats the rest."""
    shutil.copytree(run, to)
    for p in (to / "checkpoints").glob("step_*"):
        if int(p.name.split("_")[1]) > step:
            shutil.rmtree(p)
    (to / "checkpoints" / "latest").write_text(f"step_{step:06d}")
    return to / "checkpoints" / f"step_{step:06d}"


def test_tp2_checkpoint_resumes_at_tp1_and_tp1_dp2_and_back(tmp_path):
    run = ["rl.steps=3", "rl.checkpoint_every=2", "parallel.tp=2"]
    run_on_ranks(_train, 2, tp=2, args=(str(tmp_path / "tp2"), run))
    saved = _rewound_copy(tmp_path / "tp2", tmp_path / "resumed", 1)
    # TP 1 on one rank: the state's bits, then the rest of the run from step 2.
    tp1 = ["rl.steps=3", "rl.checkpoint_every=2", "parallel.tp=1"]
    resumed = run_on_ranks(_reload, 1, args=(str(saved), str(tmp_path / "at_tp1"), tp1, ["resume=true"]))[0]
    _same_checkpoint(saved, tmp_path / "at_tp1" / "checkpoints" / "step_000001")
    assert [r["step"] for r in _rows(tmp_path / "resumed")] == [0, 1, 2] and len(resumed) == 1
    full, again = _rows(tmp_path / "tp2")[2], _rows(tmp_path / "resumed")[2]
    assert full["grad_norm"] > 0 and again["mismatch/abs_diff_max"] == 0.0
    assert {k: v for k, v in again.items() if k != "grad_norm"} == {k: v for k, v in full.items() if k != "grad_norm"}
    assert abs(again["grad_norm"] - full["grad_norm"]) <= 1e-5 * full["grad_norm"]
    # TP 1 x DP 2, and back to TP 2 from what DP 2 wrote.
    dp2 = ["parallel.tp=1"]
    run_on_ranks(_reload, 2, args=(str(saved), str(tmp_path / "at_dp2"), dp2))
    at_dp2 = tmp_path / "at_dp2" / "checkpoints" / "step_000001"
    _same_checkpoint(saved, at_dp2)
    run_on_ranks(_reload, 2, tp=2, args=(str(at_dp2), str(tmp_path / "back"), ["parallel.tp=2"]))
    _same_checkpoint(saved, tmp_path / "back" / "checkpoints" / "step_000001")


def test_distributed_optimizer_state_reshards_from_dp2_to_dp1_and_tp2(tmp_path):
    run = ["rl.steps=2", "rl.checkpoint_every=2", DIST]
    run_on_ranks(_train, 2, args=(str(tmp_path / "dp2"), run))
    saved = _rewound_copy(tmp_path / "dp2", tmp_path / "resumed", 1)
    dp1 = ["rl.steps=3", DIST]
    resumed = run_on_ranks(_reload, 1, args=(str(saved), str(tmp_path / "at_dp1"), dp1, ["resume=true"]))[0]
    _same_checkpoint(saved, tmp_path / "at_dp1" / "checkpoints" / "step_000001")
    assert len(resumed) == 1 and resumed[0]["mismatch/abs_diff_max"] == 0.0 and resumed[0]["grad_norm"] > 0
    run_on_ranks(_reload, 2, tp=2, args=(str(saved), str(tmp_path / "at_tp2"), ["parallel.tp=2", DIST]))
    _same_checkpoint(saved, tmp_path / "at_tp2" / "checkpoints" / "step_000001")


FAMILIES = {
    "dense": ["model=tiny_dense"],
    "hybrid": ["model=tiny_hybrid", "profile.gdn_chunk=4"],
    "moe": ["model=tiny_moe", "parallel.sp=true"],
}


def _initial(out: str, tp: int) -> None:
    """Each family's seeded initial policy (the same HF weights at every layout) saved at TP ``tp``."""
    import torch.distributed as dist

    from megatron_iso.rl.checkpoint import save_checkpoint
    from megatron_iso.rl.trainer import Trainer
    from megatron_iso.settings.compose import load_config

    for name, overrides in FAMILIES.items():
        trainer = Trainer(
            resolve(load_config([*FAST, f"out_dir={out}/unused", *overrides, f"parallel.tp={tp}"])), dist.get_rank()
        )
        save_checkpoint(Path(out) / name, 0, trainer.model, trainer.optimizer, {}, rank=dist.get_rank())


@pytest.fixture(scope="module")
def initial_saves(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("initial")
    run_on_ranks(_initial, 2, tp=2, args=(str(root / "tp2"), 2))
    run_on_ranks(_initial, 1, args=(str(root / "tp1"), 1))
    return root


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tp_stores_the_same_tensors(initial_saves, family):
    """The stored form does not depend on the layout: the same weights saved at TP 2 and at TP 1 are the same
    tensors, bit for bit (dense; GDN's in_proj / conv1d split into head parts; MoE experts stacked)."""
    from megatron_iso.checkpoint.run_ckpt import checkpoint_tensors

    a, b = (checkpoint_tensors(initial_saves / tp / family / "checkpoints" / "step_000000") for tp in ("tp2", "tp1"))
    assert a.keys() == b.keys() and len(a) > 5
    _same_tree(a, b, family)
