"""Ranks whose engine forwards share collectives finish their rollouts together (``inference.lockstep``).

Each data-parallel rank decodes its own requests, deliberately uneven: a different number of requests (so a
different number of prefill steps under a small prefill budget), different ``max_new_tokens`` and stop tokens.
At EP 2 and EP 4 the MoE all-to-all runs over ranks that finish at different steps; without lockstep the rank
that finishes first leaves and enters the next collective (here the outputs' all-gather, as the trainer's
collectives would follow) while its peer waits in the all-to-all. TP 2 with DP 2 (dense) shares no collective
across replicas and must run without any agreement. Every real token and logprob is the bits of one engine on
one rank running all the requests together.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases

MOE = ["profile=correctness", "model=tiny_moe"]
DENSE = ["profile=correctness"]


def _requests(vocab: int, dp_rank: int) -> list:
    """Replica ``dp_rank``'s requests, deliberately uneven: replica 0 has one request of 16 new tokens (it decodes
    longest); replica d > 0 has d + 1 requests (more prefill steps) of up to 3d new tokens, the odd ones also
    stopping on a third of the vocabulary (early, data-dependent ends)."""
    stops = tuple(range(0, vocab, 3)) if dp_rank % 2 else ()
    specs = [
        (100 * dp_rank + j, 3 + 4 * j, {"temperature": 1.0, "n": 2, "stop_token_ids": stops})
        for j in range(dp_rank + 1)
    ]
    return engine_cases.requests(vocab, specs, max_new_tokens=3 * dp_rank if dp_rank else 16)


def _engine(model):
    from megatron_iso.inference import EngineConfig, RolloutEngine

    # A small prefill budget: a replica with more requests takes more prefill steps.
    return RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_prefill_tokens=8))


def _rank(overrides: list[str]) -> tuple[dict, int, int]:
    """This rank's outputs, its idle forwards, and the steps every rank agreed on (the same on all ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tc, model = engine_cases.setup(overrides)
    eng = _engine(model)
    outs = eng.generate(_requests(tc.vocab_size, parallel_state.get_data_parallel_rank()))
    mine = engine_cases.summary(outs)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, len(mine))  # the next collective after the rollout, as in the trainer
    agreed = eng.lockstep.calls if eng.lockstep is not None else -1
    return mine, eng.stats.idle_steps, agreed


def _reference(overrides: list[str], replicas: int) -> dict:
    """One engine on one rank, every replica's requests in one generate call."""
    tc, model = engine_cases.setup(overrides)
    reqs = [r for d in range(replicas) for r in _requests(tc.vocab_size, d)]
    return engine_cases.summary(_engine(model).generate(reqs))


@pytest.mark.parametrize(
    ("model", "world", "tp", "ep"),
    [("moe", 2, 1, 2), ("moe", 4, 1, 4), ("dense", 4, 2, 1)],
    ids=["ep2", "ep4", "tp2_dp2"],
)
def test_uneven_ranks_finish_together_with_the_single_rank_bits(model: str, world: int, tp: int, ep: int) -> None:
    base = MOE if model == "moe" else DENSE
    replicas = world // tp
    ref = run_on_ranks(_reference, 1, args=(base, replicas))[0]
    layout = [f"parallel.tp={tp}", f"parallel.ep={ep}"]
    # A hang (the engine before lockstep) fails within a minute: the collectives time out.
    got = run_on_ranks(_rank, world, tp=tp, ep=ep, args=([*base, *layout],), collective_timeout_s=60, timeout=240)
    seen = set()
    for rank, (mine, idle, agreed) in enumerate(got):
        assert mine, rank
        for key, (tokens, logprobs, reason) in mine.items():
            want_tokens, want_lp, want_reason = ref[key]
            assert tokens == want_tokens and reason == want_reason, (rank, key)
            assert torch.equal(bits(logprobs), bits(want_lp)), (rank, key)
            seen.add(key)
        if ep == 1:  # no collective across replicas: no agreement, no idle forward
            assert (idle, agreed) == (0, -1), rank
    assert seen == set(ref)
    assert any(reason == "stop" for _, _, reason in ref.values())  # stop tokens did end samples early
    if ep > 1:
        agreed = {a for _, _, a in got}
        assert len(agreed) == 1, agreed  # every rank left the loop at the same step
        idles = [idle for _, idle, _ in got]
        # Replica 0 decodes longest: its one idle forward is the lookahead's last step (it only records); the
        # others idled while it decoded.
        assert idles[0] <= 1 < min(idles[1:]), idles


STALL_S = 2.0


def _stalled_peer() -> tuple[int, str] | None:
    """EP 2 with ``dist_timeout_s`` = STALL_S: rank 1 stalls (never reaches the rollout) until rank 0 has
    reported; rank 0's rollout fails on its first lockstep agreement. Rank 0 returns the exit code the CLIs
    give the error and its message."""
    import torch.distributed as dist

    from megatron_iso.cli.exit_codes import report
    from megatron_iso.parallel.watchdog import CollectiveTimeout, _store

    store = _store()
    if dist.get_rank() == 1:
        store.wait(["test/reported"], datetime.timedelta(seconds=60))
        return None
    tc, model = engine_cases.setup([*MOE, "parallel.ep=2"])
    try:
        _engine(model).generate(_requests(tc.vocab_size, 0))
    except CollectiveTimeout as exc:
        return report("iso-train", exc), str(exc)
    finally:
        store.set("test/reported", "1")
    return None


def test_a_stalled_peer_is_named_in_one_line() -> None:
    code, message = run_on_ranks(_stalled_peer, 2, ep=2, collective_timeout_s=STALL_S, timeout=120)[0]
    assert code == 2, message  # cli.exit_codes.EXIT_USAGE: one line, no traceback
    assert "\n" not in message
    assert message.startswith("rollout lockstep: all-reduce #1 over ranks [0, 1] failed on rank 0 (timeout 2 s)")
    assert "rank(s) [1] did not answer" in message, message
