"""Iso profile, models with Gated DeltaNet layers: every rollout logprob the engine records equals
the trainer's teacher-forced recompute bit for bit, with the conv/recurrent state carried between
steps in the engine's GDN slot cache. GDN chunk 4, so prompts (1 to 17 tokens) and decode steps
cross chunk boundaries at every alignment; batch sizes 1/3/8, n > 1 samples forking one shared prompt
prefill, prefix caching on and off, staggered arrivals (tiny_hybrid_moe, tiny_moe and TP 2:
test_engine_hybrid_tp.py). Also: no cross-request prefix hit for GDN
models, the contract's recurrent-state flush on weight sync, and the native profile's mismatch."""

from __future__ import annotations

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import hybrid_cases
from tests.inference.test_engine_bitwise import _check_run, _same_outputs

CHUNKED = [f"profile.gdn_chunk={hybrid_cases.CHUNK}"]


def check_runs(model: str, runs: dict) -> None:
    """Every run trainer-equal bit for bit, and the same samples as the first run (batching, prefix
    caching, arrival order and schedule change nothing)."""
    reference = next(iter(runs.values()))[0]
    assert len(reference) == 12 and sum(len(v[0]) for v in reference.values()) > 40  # 8 requests, 12 samples
    for name, run in runs.items():
        _check_run(f"{model}.{name}", run)
        assert _same_outputs(run[0], reference), f"{model}.{name} differs from {next(iter(runs))}"
    assert len({tuple(v[0]) for v in reference.values()}) == len(reference)


def test_hybrid_rollout_logprobs_equal_trainer():
    runs = run_on_ranks(hybrid_cases.schedules, 1, args=(["model=tiny_hybrid", *CHUNKED], (1, 3)))[0]
    assert sorted(runs) == ["bs1_prefixTrue", "bs3_prefixFalse", "bs3_prefixTrue", "staggered"]
    check_runs("tiny_hybrid", runs)


def test_group_shares_one_prefill_no_cross_request_hit_and_flush():
    out = run_on_ranks(hybrid_cases.group_reuse_and_flush, 1, args=(["model=tiny_hybrid", *CHUNKED],))[0]
    assert len(out["first"]) == 4 and all(v[1].numel() == 4 for v in out["first"].values())
    _check_run("first", (out["first"], out["first_trainer"]))
    _check_run("after_sync", (out["after"], out["after_trainer"]))
    # One prompt prefill per group (10 tokens, not 40), and no prefix hit on the warm engine: a GDN
    # state cannot be rebuilt from the 2 cached KV blocks, so the prompt is prefilled again.
    assert out["prefill_tokens"] == (10, 10) and out["hit_tokens"] == 0 and out["kv_cached_blocks"] == 2
    assert _same_outputs(out["first"], out["second"]) and _same_outputs(out["first"], out["alone"])
    assert len({tuple(v[0]) for v in out["first"].values()}) == 4
    assert out["slots_free"] == (64, 64)  # every slot back after the copy-on-write forks
    # Weight sync: the recurrent state is flushed (zeroed) and results match a fresh engine, not the old weights.
    assert out["flushes"] == 1 and out["state_zero"]
    assert _same_outputs(out["after"], out["fresh"]) and not _same_outputs(out["after"], out["first"])


def test_native_hybrid_mismatch_is_measured():
    gap = run_on_ranks(hybrid_cases.native_gap, 1, args=(["model=tiny_hybrid", *CHUNKED],))[0]
    print(f"native profile tiny_hybrid: max |rollout logprob - trainer logprob| = {gap:.3e} (iso profile: 0)")
    assert gap > 0.0  # the native chunked prefill and recurrent decode are different arithmetic
