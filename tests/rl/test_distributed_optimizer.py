"""rl.use_distributed_optimizer: Megatron's DistributedOptimizer on 2 gloo ranks (DP 2) against the replicated one.

What stays bit for bit, and why: the rollout and trainer logprobs of step 0 (same weights); with
``rl.grad_clip=0`` every step (each element's Adam update is the same elementwise arithmetic on a slice of
the buffer, and a sum of two ranks' grads is the same sum as a reduce-scatter or an all-reduce). What may move
in the last bits: with clipping on, the grad norm (partial norms of each rank's slice, summed over DP, against
one sum per tensor), hence the clip factor and the updates after step 0. The run checkpoint holds the sharded
Adam state (Megatron's fully reshardable form): a resumed run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_iso.rl.run import TIMING_PREFIXES
from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

FAST = [
    "rl.group_size=4",
    "rl.max_response_length=3",
    "task.prompts_per_step=2",
    "logger=none",
    "rl.checkpoint_every=2",
]
DIST = "rl.use_distributed_optimizer=true"


def _runs(root: str) -> dict:
    from megatron_iso.parallel.world import seed_ranks
    from megatron_iso.rl.checkpoint import CheckpointError
    from megatron_iso.rl.run import train
    from megatron_iso.settings.compose import load_config

    def run(name: str, *overrides: str) -> None:
        cfg = load_config([*FAST, f"out_dir={root}/{name}", *overrides])
        seed_ranks(int(cfg.seed))
        train(cfg)

    run("plain_noclip", "rl.steps=3", "rl.grad_clip=0")
    run("dist_noclip", "rl.steps=3", "rl.grad_clip=0", DIST)
    run("plain", "rl.steps=3")
    run("dist", "rl.steps=3", DIST)
    run("dist_cut", "rl.steps=2", DIST)
    run("dist_cut", "rl.steps=3", DIST, "resume=true")
    try:
        run("plain", "rl.steps=4", DIST, "resume=true")
        refused = ""
    except CheckpointError as exc:
        refused = str(exc)
    return {"refused": refused}


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def _but_norm(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "grad_norm"}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from megatron_iso.checkpoint.run_ckpt import checkpoint_tensors

    return checkpoint_tensors(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip())


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def test_distributed_optimizer_matches_the_replicated_one_and_resumes_exactly(tmp_path):
    out = run_on_ranks(_runs, 2, args=(str(tmp_path),), timeout=600)
    # Without clipping: the same run, every metric but the reported grad norm and the final weights bit for bit.
    plain, dist = _rows(tmp_path / "plain_noclip"), _rows(tmp_path / "dist_noclip")
    assert [_but_norm(r) for r in dist] == [_but_norm(r) for r in plain]
    for a, b in zip(plain, dist, strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
    assert _same_bits(_weights(tmp_path / "dist_noclip"), _weights(tmp_path / "plain_noclip"))
    # With clipping: step 0 is the same (logprobs, rewards, mismatch, loss); the grad norm and later steps close.
    plain, dist = _rows(tmp_path / "plain"), _rows(tmp_path / "dist")
    assert plain[0]["grad_norm"] > 1.0  # rl.grad_clip=1 clips
    for key in ("loss", "reward/mean", "mismatch/abs_diff_max", "mismatch/bitwise_equal_frac"):
        assert dist[0][key] == plain[0][key], key
    for a, b in zip(plain, dist, strict=True):
        assert a["mismatch/abs_diff_max"] == b["mismatch/abs_diff_max"] == 0.0
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5
    # Exact resume from the sharded optimizer state: the steps after it and the final weights, bit for bit.
    assert _rows(tmp_path / "dist_cut") == dist
    assert _same_bits(_weights(tmp_path / "dist_cut"), _weights(tmp_path / "dist"))
    assert "use_distributed_optimizer=False" in out[0]["refused"]
