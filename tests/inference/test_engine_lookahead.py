"""Lookahead decoding (EngineConfig.lookahead): launching decode step n + 1 before step n's tokens are read
changes no output. Tokens, logprob bits and finish reasons equal the step-by-step engine's, with stop tokens
(a sample that stops gets one lookahead row, dropped), several samples per prompt, top-k/top-p rows, staggered
arrivals and a tight KV budget that makes requests wait. (Decode graph buffers under lookahead, the engine's
default: tests/inference/test_decode_graphs.py.)"""

from __future__ import annotations

import torch

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases


def _bits(outs) -> dict:
    return {k: (tok, lp.view(torch.int32).tolist(), why) for k, (tok, lp, why) in engine_cases.summary(outs).items()}


def _run(lookahead: bool, kv_cache_bytes: int, stop: bool) -> dict:
    from megatron_iso.inference import EngineConfig, RolloutEngine

    tc, model = engine_cases.setup(["model=tiny_dense", "profile=correctness"])
    # Stop ids: tokens a tiny random model draws now and then, so some samples stop early and others run on.
    extra = {"stop_token_ids": tuple(range(0, tc.vocab_size, 7))} if stop else {}
    reqs = engine_cases.requests(tc.vocab_size, max_new_tokens=9, **extra)
    cfg = EngineConfig(kv_cache_bytes=kv_cache_bytes, block_size=4, max_num_seqs=8, lookahead=lookahead)
    eng = RolloutEngine(model, cfg)
    outs = engine_cases.run_schedule(eng, reqs, engine_cases.STAGGERED_ARRIVALS)
    return {"bits": _bits(outs), "generated": eng.stats.generated_tokens, "steps": eng.stats.steps}


def _all() -> dict:
    out = {}
    for kv, stop in ((64 << 20, True), (64 << 20, False), (96 << 10, True)):
        out[(kv, stop)] = (_run(False, kv, stop), _run(True, kv, stop))
    return out


def test_lookahead_changes_no_output():
    res = run_on_ranks(_all, 1)[0]
    stopped = 0
    for case, (plain, ahead) in res.items():
        assert ahead["bits"] == plain["bits"], case
        assert ahead["generated"] == plain["generated"], case  # dropped lookahead rows are not counted
        stopped += sum(why == "stop" for _, _, why in plain["bits"].values())
    assert stopped > 0  # the stop-token path was exercised
