"""Issue 14's key bitwise claims over torchrun ranks: NCCL on GPUs, gloo on CPU (same code in CI).

The ranks are started by :func:`megatron_iso.parallel.torchrun.run_under_torchrun`: with two or
more GPUs each rank runs on ``cuda:<LOCAL_RANK>`` over NCCL, otherwise gloo CPU ranks run the very
same rank functions. The claims are the ones the gloo tests make, through their own functions:

* dense logprobs at TP=2, SP off and on, equal TP=1 (``test_dense_invariance._score``);
* MoE logprobs at EP=2 equal EP=1 (the same ``_score`` on ``tiny_moe``);
* rollout TP=1 under trainer TP=2: zero mismatch, and the same run as the colocated one
  (``test_rollout_layout._train``).

Three launches do it all (the reference world of one rank, the TP=2 world, the EP=2 world): a
launch costs seconds of process start and Megatron import on a 2-core CI machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from megatron_iso.parallel.torchrun import run_under_torchrun
from tests.models.test_dense_invariance import ALL, _equal, _max_diff, _score
from tests.rl.test_rollout_layout import _computed, _train

pytestmark = pytest.mark.slow

# NCCL needs one GPU per rank; with fewer than two, the ranks are gloo CPU ranks (CI).
ON_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
DEVICES = "auto" if ON_GPUS else "cpu"
DTYPES = ("fp32", "bf16")
# The tiny models widened to sizes the GPU leaf-tree GEMM can walk (every row-parallel K / leaves a
# multiple of the K tile: contract.build.check_gpu_gemm_shapes refuses tiny_dense's ffn 128 on CUDA).
# The same shapes on CPU, so CI runs what the GPUs run.
DENSE = ["model.ffn_hidden_size=512", "model.kv_channels=64"]
MOE = ["model=tiny_moe", *DENSE, "model.moe_ffn_hidden_size=64", "model.shared_expert_ffn_hidden_size=512"]
SPLIT = [*DENSE, "parallel.tp=2", "rollout.parallel.tp=1"]


def _each(calls: Sequence[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """Several claim functions in one world (one launch); results in call order."""
    return [fn(*args) for fn, args in calls]


def _world() -> dict[str, str]:
    """How this rank's world was made: the backend and where the model would live."""
    import torch.distributed as dist

    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return {"backend": str(dist.get_backend()), "device": device}


def _launch(world: int, calls: list[tuple[Callable[..., Any], tuple]], **layout: int) -> list[list[Any]]:
    return run_under_torchrun(_each, world, args=([(_world, ()), *calls],), devices=DEVICES, **layout)


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    """TP=EP=1 on one rank (cuda:0 on GPUs: the same device class as the layouts it is compared with)."""
    calls = [(_score, ([*DENSE, f"model.params_dtype={d}"], ALL)) for d in DTYPES]
    calls.append((_score, (MOE, ALL)))
    return _launch(1, calls)[0]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[list[Any]]:
    out = tmp_path_factory.mktemp("tp2")
    calls: list = [
        (_score, ([*DENSE, f"model.params_dtype={d}", "parallel.tp=2", f"parallel.sp={sp}"], ALL))
        for d in DTYPES
        for sp in (False, True)
    ]
    calls += [(_train, (str(out / "split"), SPLIT)), (_train, (str(out / "colocated"), [*DENSE, "parallel.tp=2"]))]
    return _launch(2, calls, tp=2)


@pytest.fixture(scope="module")
def ep2() -> list[list[Any]]:
    return _launch(2, [(_score, ([*MOE, "parallel.ep=2"], ALL))], ep=2)


def test_ranks_run_on_the_expected_backend(tp2, ep2):
    """On GPUs the claims below are NCCL claims: one rank per GPU, not gloo or a shared device."""
    for world in (tp2, ep2):
        for rank, results in enumerate(world):
            want = {"backend": "nccl", "device": f"cuda:{rank}"} if ON_GPUS else {"backend": "gloo", "device": "cpu"}
            assert results[0] == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sp", [False, True], ids=["sp0", "sp1"])
def test_dense_logprobs_tp2_equal_tp1(reference, tp2, dtype, sp):
    ref = reference[1 + DTYPES.index(dtype)]
    i = 1 + 2 * DTYPES.index(dtype) + int(sp)
    for rank, results in enumerate(tp2):
        got = results[i]
        assert _equal(ref, got), f"rank {rank} TP=2 SP={sp} {dtype}: max |dlogp| {_max_diff(ref, got):.3e}"


def test_moe_logprobs_ep2_equal_ep1(reference, ep2):
    ref = reference[3]
    for rank, results in enumerate(ep2):
        assert _equal(ref, results[1]), f"rank {rank} EP=2: max |dlogp| {_max_diff(ref, results[1]):.3e}"


def test_rollout_tp1_under_trainer_tp2_zero_mismatch_and_same_run(tp2):
    split = [results[5] for results in tp2]
    colocated = [results[6] for results in tp2]
    assert len(split[0]) == 2 and split[0][0]["grad_norm"] > 0  # the weights moved: a stale rollout would show
    for r in split[0]:
        assert r["mismatch/abs_diff_max"] == 0.0
        assert r["mismatch/bitwise_equal_frac"] == 1.0
    assert _computed(split[0]) == _computed(split[1])
    assert _computed(split[0]) == _computed(colocated[0])
