"""Decode steps from static bucket buffers (the CUDA-graph path, run eagerly on CPU) == eager steps.

A captured graph replays whatever its static buffers hold, so everything position-dependent must come
from them: the step's rows are copied in, padding rows point at the scratch block, and the attention
reads start positions and ``cu_seqlens`` from device tensors (the host plan of a bucket is stale by
design). On CPU the paged Triton call is replaced by a stand-in that follows the kernel's contract
exactly that way: it reads ``cache_seqlens``, ``cu_seqlens_q``, the block-table rows of ``slots`` and
``write_idx``, and never the plan. The claims: rollout tokens and logprobs are the eager engine's bits
with sequences finishing at different steps (rows go back to padding), staggered arrivals and small
buckets (every step is padded); the scratch block is never handed to a sequence; live blocks are never
written by padding rows. The captured graph itself: tests/gpu/test_decode_graphs.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases


def _run(static: bool, buckets: list[int] | None, profile: str = "correctness") -> dict:
    """:func:`engine_cases.staggered_run` of the dense model, recording the scratch block, every block a sequence
    ever holds and (correctness profile) every KV write index."""
    _, model = engine_cases.setup([f"profile={profile}"])
    writes: list[torch.Tensor] = []
    held: set[int] = set()

    def watch(eng) -> None:
        real_prepare = eng.kv.prepare_append

        def prepare(seq_id, start, count):  # every block a sequence ever holds
            real_prepare(seq_id, start, count)
            held.update(eng.kv.tables[seq_id])

        eng.kv.prepare_append = prepare

    # The performance profile stages on CUDA too: its own kernels run here.
    paged = profile == "correctness"
    run = engine_cases.staggered_run(model, static=static, buckets=buckets, paged=paged, writes=writes, watch=watch)
    eng = run.engine
    assert "CUDA" in run.graphs_off, run.graphs_off
    return {
        "summary": run.summary,
        "steps": eng.stats.steps,
        "scratch": eng.decode_graphs.scratch if static else None,
        "held": held,
        "writes": writes,
        "block_size": eng.kv.block_size,
        "num_decode_rows": eng.stats.decode_tokens,
        "static_steps": run.static_steps,
    }


def _all() -> dict:
    return {
        "eager": _run(False, None),
        "static": _run(True, None),
        "padded": _run(True, [2, 5, 6]),
        "native_eager": _run(False, None, "performance"),
        "native_padded": _run(True, [2, 5, 6], "performance"),
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_on_ranks(_all, 1)[0]


def test_static_decode_steps_give_the_eager_bits(runs) -> None:
    eager = runs["eager"]["summary"]
    assert len(eager) >= 8
    for name in ("static", "padded"):
        engine_cases.assert_same_outputs(eager, runs[name]["summary"], f"{name} vs eager")
        # Every step but the (at most 8, one per request) prefill steps came from bucket buffers.
        assert runs[name]["static_steps"] >= runs[name]["steps"] - 8 > 0, (
            runs[name]["static_steps"],
            runs[name]["steps"],
        )
    assert runs["eager"]["static_steps"] == 0


def test_padding_rows_write_only_the_scratch_block(runs) -> None:
    for name in ("static", "padded"):
        r = runs[name]
        assert r["held"], "the watcher saw no block handed to a sequence"
        assert r["scratch"] not in r["held"], "the scratch block was handed to a sequence"
        bs, scratch = r["block_size"], r["scratch"]
        padded_writes = sum(int((w // bs == scratch).sum()) for w in r["writes"])
        total = sum(int(w.numel()) for w in r["writes"])
        # Bucket sizes 2/5/6 over 1..6 running rows: some steps must be padded, and the real rows'
        # writes (prefill tokens + decode rows, per layer) are all the others.
        if name == "padded":
            assert padded_writes > 0
        layers = len(r["writes"]) // r["steps"]
        assert total - padded_writes == layers * (r["num_decode_rows"] + _prefill_rows(runs["eager"]))


def _prefill_rows(eager: dict) -> int:
    per_layer = [int(w.numel()) for w in eager["writes"]]
    layers = len(per_layer) // eager["steps"]
    return sum(per_layer) // layers - eager["num_decode_rows"]


def test_default_buckets_cover_every_batch() -> None:
    from megatron_iso.inference.cuda_graphs import default_buckets

    for top in (1, 3, 8, 64, 100, 256):
        b = default_buckets(top)
        assert b[-1] == top and b == sorted(set(b)) and b[0] == 1
        # at most 25% padding past batch 8 (1/2 below: 5 -> 8)
        assert all(next(x for x in b if x >= n) <= max(2 * n, n + n // 4 + 8) for n in range(1, top + 1))


def test_warm_prepares_every_bucket_a_batch_walks_down() -> None:
    """A batch's sequences finish at different steps, so its decode steps pass through every smaller bucket:
    ``warm`` prepares (captures, on a GPU) all of them, and none larger."""
    assert run_on_ranks(_warmed_buckets, 1)[0] == ([1, 2, 4, 8, 16, 24], [1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 24])


def _warmed_buckets() -> tuple[list[int], ...]:
    from megatron_iso.inference import EngineConfig, RolloutEngine

    _, model = engine_cases.setup(["profile=correctness"])
    eng = RolloutEngine(model, EngineConfig(max_num_seqs=24, kv_cache_bytes=8 << 20, block_size=16))
    graphs = eng.enable_decode_graphs(capture=False)
    graphs.warm(9, 40)
    walked = sorted(rows for rows, _ in graphs._buckets)
    graphs.warm(100, 40)  # more rows than any bucket: every bucket
    return list(graphs.buckets), walked, sorted(rows for rows, _ in graphs._buckets)


def test_native_static_decode_reads_positions_on_the_device(runs) -> None:
    """The performance profile's staged decode from bucket buffers (placeholder host starts, positions in
    ``cache_seqlens``, a 256-token staging bucket): the eager tokens, logprobs within fp32 rounding."""
    eager, static = runs["native_eager"]["summary"], runs["native_padded"]["summary"]
    assert runs["native_padded"]["static_steps"] >= runs["native_padded"]["steps"] - 8 > 0
    assert static.keys() == eager.keys()
    worst = 0.0
    for key, (tok, lp, reason) in eager.items():
        tok2, lp2, reason2 = static[key]
        assert tok == tok2 and reason == reason2, key
        worst = max(worst, float((lp - lp2).abs().max()))
    print(f"native static vs eager decode: max |dlogp| {worst:.3e}")
    assert worst < 1e-5, worst  # a wrong position or mask moves logprobs by O(1), fp32 reordering by ~1e-7


def test_placeholder_starts_refused_where_host_starts_are_read() -> None:
    from megatron_iso.ops.attention import KVStepPlan, attention_with_kv_cache

    q, kv = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    plan = KVStepPlan([0, 1, 2], [0, 0], [0, 1], device_positions=True)
    with pytest.raises(ValueError, match="device_positions"):  # the CPU reference reads plan.starts
        attention_with_kv_cache(
            q, kv, kv, cache, cache.clone(), torch.tensor([2, 3]), torch.tensor([0, 1, 2]), plan=plan,
            profile="correctness",
        )  # fmt: skip


def _native_long(static: bool, fail_first_run: bool = False) -> list:
    """Performance profile, prompts of 30 to 251 tokens generating past 256: staging lengths 256 and 512,
    many 64-key tiles. ``fail_first_run``: every bucket's first run raises in the second attention layer
    (what a capture-unsafe op does inside ``_capture``), and the step is then served eagerly."""
    from megatron_iso.inference import EngineConfig, Request, RolloutEngine, SamplingParams
    from megatron_iso.models import modules

    tc, model = engine_cases.setup(["profile=performance"])
    eng = RolloutEngine(model, EngineConfig(max_num_seqs=6, kv_cache_bytes=8 << 20, block_size=16))
    if static:
        graphs = eng.enable_decode_graphs(capture=False)
        graphs.buckets = [2, 5, 6]
        if fail_first_run:
            real_bucket, real_attend, seen = graphs._bucket, modules.PackedCoreAttention.forward, set()

            def raising(self, *args, **kwargs):
                if self.layer_index == 1:
                    raise RuntimeError("capture-unsafe op")
                return real_attend(self, *args, **kwargs)

            def first_run_fails(key):
                bucket = real_bucket(key)
                if key not in seen:
                    seen.add(key)
                    modules.PackedCoreAttention.forward = raising
                    try:
                        graphs._run(bucket)
                    except RuntimeError:
                        pass
                    finally:
                        modules.PackedCoreAttention.forward = real_attend
                return bucket

            graphs._bucket = first_run_fails
    reqs = []
    for i, n in enumerate([250, 240, 30, 251, 200]):
        prompt = torch.randint(0, tc.vocab_size, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        reqs.append(Request(i, prompt, SamplingParams(max_new_tokens=12 + 3 * i, seed=5, temperature=1.0)))
    outs = eng.generate(reqs)
    keys = sorted(eng.decode_graphs._buckets) if static else []
    return [keys, [(o.samples[0].tokens, torch.tensor(o.samples[0].logprobs)) for o in outs]]


def _native_long_runs() -> dict:
    return {"eager": _native_long(False), "static": _native_long(True), "failed": _native_long(True, True)}


def test_native_static_decode_across_staging_lengths_and_failed_captures() -> None:
    runs = run_on_ranks(_native_long_runs, 1)[0]
    _, eager = runs["eager"]
    for name in ("static", "failed"):
        keys, got = runs[name]
        assert {length for _, length in keys} >= {256, 512}, keys  # the staging length grew mid-rollout
        for (tok, lp), (tok2, lp2) in zip(eager, got, strict=True):
            assert tok == tok2, name
            # The native profile is not batch invariant: a padded graph batch moves its fp32 logprobs in the last
            # bits, by more than 1e-5 on some runs; the tokens must not move.
            assert float((lp - lp2).abs().max()) < 1e-4, name


INTERPRETED = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.inference import EngineConfig, Request, RolloutEngine, SamplingParams
    from megatron_iso.models import modules
    from megatron_iso.ops.attention import attention_triton
    from megatron_iso.testing.harness import run_on_ranks

    def paged(*args, profile=None, **kwargs):  # the real kernel, dispatched as on CUDA
        return attention_triton.attention_with_paged_kv_cache(*args, **kwargs)

    def generate(static):
        from tests.inference import engine_cases

        tc, model = engine_cases.setup(["profile=correctness", "model.num_layers=2"])
        modules.paged_kv_reads = lambda q, profile: profile == "correctness"
        modules.attention_with_paged_kv_cache = paged
        eng = RolloutEngine(model, EngineConfig(max_num_seqs=4, kv_cache_bytes=4 << 20, block_size=16))
        if static:
            eng.enable_decode_graphs(capture=False).buckets = [3, 4]
        reqs = []
        for i, n in enumerate([70, 58, 9]):  # decode crosses the 64-key tile and block boundaries
            prompt = torch.randint(0, tc.vocab_size, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            reqs.append(Request(i, prompt, SamplingParams(max_new_tokens=4 + 4 * i, seed=3, temperature=1.0)))
        outs = eng.generate(reqs)
        steps = eng.decode_graphs.steps if static else 0
        return steps, [(o.samples[0].tokens, torch.tensor(o.samples[0].logprobs)) for o in outs]

    def check():
        (_, eager), (steps, static) = generate(False), generate(True)
        assert steps > 0
        for (tok, lp), (tok2, lp2) in zip(eager, static, strict=True):
            assert tok == tok2 and torch.equal(lp.view(torch.int32), lp2.view(torch.int32)), (tok, tok2)
        return steps

    if __name__ == "__main__":  # the rank process imports this file again
        print("static decode steps", run_on_ranks(check, 1)[0])
    """
)


def test_static_decode_with_the_real_paged_kernel_interpreted(tmp_path) -> None:
    """The Triton paged attention itself (TRITON_INTERPRET=1) on bucket buffers with placeholder host
    starts: the eager engine's bits, with decode positions crossing a 64-key tile."""
    pytest.importorskip("triton")
    from megatron_iso.testing.triton_interpret import run_interpreted

    script = tmp_path / "static_decode_interpreted.py"
    root = Path(__file__).resolve().parents[2]  # the child imports tests.inference.engine_cases
    script.write_text(f"import sys\nsys.path.insert(0, {str(root)!r})\n" + INTERPRETED)
    done = run_interpreted(script=script, timeout=900)
    assert done.returncode == 0 and "static decode steps" in done.stdout, done.stderr[-3000:]
