"""Engine behaviour: the n samples share one prompt prefill, prefix reuse across requests, the
contract's flush on weight sync, stop tokens, per-request errors; the native profile's rollout vs
trainer mismatch and CPU tokens/s are measured and printed."""

from __future__ import annotations

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases


def test_behaviour():
    out = run_on_ranks(engine_cases.behaviour, 1, args=([],))[0]
    # n=4 samples of a 10-token prompt: one prefill with sharing, four without; same samples.
    shared, shared_prefill = out["group_prefixTrue"]
    alone, alone_prefill = out["group_prefixFalse"]
    assert shared_prefill == 10 and alone_prefill == 40
    assert engine_cases._same(shared, alone) and len(shared) == 4
    assert len({tuple(v[0]) for v in shared.values()}) == 4

    reuse = out["reuse"]
    assert reuse["cached_blocks"] == 2  # full blocks of the 10-token prompt (block size 4)
    assert reuse["second_prefill_tokens"] == 2 and reuse["hit_tokens"] == 8
    assert reuse["same"]

    flush = out["flush"]
    assert flush["version"] == 1 and flush["cached_blocks"] == 0 and flush["new_hits"] == 0
    assert flush["result_version"] == 1
    assert flush["same_as_fresh"] and flush["differs_from_old"] and flush["trainer_equal"]

    toks, stopped, reason, first = out["stop"]
    assert reason == "stop" and stopped == toks[: first + 1]

    errors = {rid: (err, samples) for rid, err, samples in out["errors"]}
    assert "max_model_len=32" in errors[1][0]
    assert "SamplingParams.temperature=-1.0" in errors[2][0]
    assert "SamplingParams.top_p=0.0" in errors[3][0]
    assert "outside [0, 256)" in errors[4][0]
    assert "prompt is empty" in errors[6][0]
    assert errors[5] == (None, [(4, "length")])
    assert errors[7] == (None, [(22, "length")])  # 10 prompt + 22 new = max_model_len 32
    assert "running sequences" in out["sync_while_running"]


def test_native_profile_mismatch_is_measured():
    gap = run_on_ranks(engine_cases.native_gap, 1, args=([],))[0]
    print(f"native profile: max |rollout logprob - trainer logprob| = {gap:.3e} (iso profile: 0)")
    assert gap >= 0.0


def test_cpu_throughput_is_reported():
    for batch in (1, 8):
        tps, stats = run_on_ranks(engine_cases.throughput, 1, args=([], batch, 16))[0]
        print(f"tiny_dense CPU batch {batch}: {tps:.1f} generated tokens/s ({stats})")
        assert stats["generated_tokens"] == 16 * batch
