"""Profile rollout generation (the bundled decoder) and print where a step's time goes.

python tools/profile_decode.py --model qwen3_0p6b --profile correctness --prompts 8 --group 8 --new-tokens 8
python tools/profile_decode.py --split --profile performance --prompts 8 --group 8 --new-tokens 32
python tools/profile_decode.py --split --model qwen3_0p6b --set model.num_layers=2 --profile performance

Default: torch.profiler's top ops and per-module parts (``megatron_iso.bench.profiling``). ``--split``: wall time of uninstrumented runs (best of
``--repeat``), then one cProfile run attributing that time to the model forward, the KV staging
inside it (``PagedStepView``), the sampler and the rest of the engine's host work.
``--graph-split`` (CUDA, decode graphs on): a decode step's wall time in the engine against its bucket's graph
replayed alone (the difference is host work left on the critical path), then the kernels of one step of that
bucket run eagerly, by total device time.
``--host-only`` (any machine): the engine's own host work per decode step, with the model's forward and the draw
stubbed out (preallocated logits and tokens) and decode steps served from the bucket buffers as on a GPU
(``enable_decode_graphs(capture=False)``: the decode-graph host code, nothing replayed). What a step costs the host
at a GPU workload's batch and context, measured without the GPU.

python tools/profile_decode.py --graph-split --model qwen3_0p6b --prompts 64 --group 1 --prompt-len 512
python tools/profile_decode.py --host-only --model qwen3p5_small_hybrid_moe --prompts 32 --group 1 --prompt-len 4096
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_iso.bench.profiling import module_ranges, print_summary, summarize

# (label, module path suffix, function name): cumulative cProfile time of each part of a step.
_PARTS = (
    ("forward (incl. KV staging)", "models/gpt.py", "forward_packed"),
    ("  KV staging: layer()", "inference/kv_blocks.py", "layer"),
    ("  KV staging: finish()", "inference/kv_blocks.py", "finish"),
    ("step views (block tables)", "inference/kv_blocks.py", "step_view"),
    ("pack (IsoBatch)", "models/batch.py", "pack"),
    ("draw (_draw)", "inference/engine.py", "_draw"),
    ("record (_record)", "inference/engine.py", "_record"),
    ("admission (_admit)", "inference/engine.py", "_admit"),
    ("fork (_fork)", "inference/engine.py", "_fork"),
)


def _cumulative(stats: pstats.Stats, path: str, name: str) -> float:
    total = 0.0
    for (file, _, func), (_, _, _, ct, callers) in stats.stats.items():
        # Recursive/nested calls of the same function would count twice; only top-level entries are summed.
        if func == name and file.endswith(path) and not any(c[2] == name and c[0] == file for c in callers):
            total += ct
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_dense")
    parser.add_argument("--profile", default="correctness")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override, e.g. --set model.num_layers=2 (Qwen3-0.6B shapes with few layers on CPU)",
    )
    parser.add_argument("--split", action="store_true", help="time split (forward / KV staging / sampler / rest)")
    parser.add_argument("--repeat", type=int, default=2, help="--split: uninstrumented runs (best is reported)")
    parser.add_argument("--graph-split", action="store_true", help="decode step vs its graph replayed alone (CUDA)")
    parser.add_argument("--steps", type=int, default=50, help="--graph-split: decode steps timed")
    parser.add_argument("--host-only", action="store_true", help="host ms per decode step, forward and draw stubbed")
    args = parser.parse_args(argv)

    from megatron_iso.inference.engine import EngineConfig, RolloutEngine
    from megatron_iso.inference.params import Request, SamplingParams
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.parallel.world import launched_world
    from megatron_iso.settings.compose import load_config

    cfg = load_config([f"model={args.model}", f"profile={args.profile}", *args.set])
    with launched_world(seed=0):
        tc = transformer_config(cfg)
        model = build_model(tc, random_hf_state_dict(tc, seed=0)).eval()
        engine = RolloutEngine(model, EngineConfig(kv_cache_bytes=4 << 30, max_num_seqs=args.prompts * args.group))
        params = SamplingParams(max_new_tokens=args.new_tokens, n=args.group, seed=0)
        prompts = [
            torch.randint(
                0, min(1000, tc.vocab_size), (args.prompt_len,), generator=torch.Generator().manual_seed(i)
            ).tolist()
            for i in range(args.prompts)
        ]

        def run(tag: str) -> None:
            engine.generate([Request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)])
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        if args.graph_split:
            return _graph_split(engine, prompts, args)
        if args.host_only:
            return _host_only(engine, run, args)
        with torch.no_grad():
            run("warm")
            if args.split:
                return _split(engine, run, args)
            cuda = torch.cuda.is_available()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof, module_ranges(model):
                run("")
    print_summary(summarize(prof, args.rows, device=cuda))
    return 0


def _split(engine, run, args) -> int:
    walls, steps = [], []
    for r in range(args.repeat):
        s0, t0 = engine.stats.steps, time.perf_counter()
        run(f"r{r}_")
        walls.append(time.perf_counter() - t0)
        steps.append(engine.stats.steps - s0)
    wall, nsteps = min(walls), steps[0]
    tokens = args.prompts * args.group * args.new_tokens
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run("prof_")
    prof.disable()
    prof_wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    print(
        f"model={args.model} profile={args.profile} sequences={args.prompts}x{args.group} "
        f"prompt={args.prompt_len} new={args.new_tokens} threads={torch.get_num_threads()}"
    )
    print(
        f"wall {wall:.3f} s (best of {args.repeat}), {nsteps} steps, {wall / nsteps * 1e3:.2f} ms/step, "
        f"{tokens / wall:.0f} tok/s"
    )
    print(f"cProfile run: {prof_wall:.3f} s (instrumented); share of it per part, and that share of the wall time:")
    parts = {label: _cumulative(stats, path, name) for label, path, name in _PARTS}
    for label, t in parts.items():
        print(f"  {label:<30s} {t / prof_wall * 100:5.1f}%  {t / prof_wall * wall / nsteps * 1e3:7.2f} ms/step")
    top = [label for label in parts if not label.startswith(" ")]
    rest = prof_wall - sum(parts[label] for label in top)
    print(
        f"  {'rest of engine.step':<30s} {rest / prof_wall * 100:5.1f}%  {rest / prof_wall * wall / nsteps * 1e3:7.2f} ms/step"
    )
    if args.rows:
        stats.sort_stats("tottime").print_stats(args.rows)
    _op_counts(run, nsteps)
    return 0


def _host_only(engine, run, args) -> int:
    """Host milliseconds per engine step with the forward and the draw costing nothing: the forward returns a view of
    one zero row (a long prefill allocates nothing), the draw preallocated token 0 (no request stops early)."""
    model, rows = engine.model, args.prompts * args.group
    vocab = int(getattr(model.config, "padded_vocab_size", 0) or model.config.vocab_size)
    zero_row = torch.zeros(1, vocab)

    def forward(ids: torch.Tensor, _batch: object) -> torch.Tensor:
        return zero_row.expand(ids.numel(), vocab)

    model.forward_packed = engine.forward_fn = forward
    graphs = engine.enable_decode_graphs(capture=False)
    tokens, logprobs = torch.zeros(rows, dtype=torch.long), torch.zeros(rows)
    engine.drawer.plain = lambda logits, *_: (tokens[: logits.shape[0]], logprobs[: logits.shape[0]])
    step = engine.step
    decode: list[float] = []  # engine steps that launched a decode step from the bucket buffers (no prefill)

    def timed_step():
        served, t0 = graphs.steps, time.perf_counter()
        out = step()
        if graphs.steps > served and engine.stats.prefill_tokens == prefilled[0]:
            decode.append((time.perf_counter() - t0) * 1e3)
        prefilled[0] = engine.stats.prefill_tokens
        return out

    prefilled = [engine.stats.prefill_tokens]
    engine.step = timed_step
    run("host_")
    decode.sort()
    print(
        f"model={args.model} profile={args.profile} rows={rows} prompt={args.prompt_len} new={args.new_tokens}: "
        f"host {decode[len(decode) // 2]:.3f} ms per decode step (median of {len(decode)}, "
        f"p90 {decode[int(len(decode) * 0.9)]:.3f}); {graphs.steps} steps from the bucket buffers"
    )
    return 0


def _graph_split(engine, prompts: list[list[int]], args) -> int:
    from megatron_iso.inference.params import Request, SamplingParams

    graphs = engine.decode_graphs
    if graphs is None:
        print(f"--graph-split needs decode graphs: {engine.decode_graphs_status()}", file=sys.stderr)
        return 2
    rows = args.prompts * args.group
    params = SamplingParams(max_new_tokens=args.new_tokens + args.steps + 16, n=args.group, seed=0)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"g{i}", p, params))
    graphs.warm(rows, args.prompt_len + 1)
    with torch.no_grad():
        while engine.stats.decode_tokens < rows * args.new_tokens:  # past the prefill, into steady decode
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        bucket = graphs._last[0] if graphs._last else None  # the bucket the last steps replayed
        if bucket is None or bucket.graph is None:
            print(f"no captured bucket served the steps: {engine.decode_graphs_status()}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        for _ in range(args.steps):
            bucket.graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t0) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._run(bucket)
            torch.cuda.synchronize()
    print(
        f"model={args.model} profile={args.profile} rows={rows} (bucket {bucket.rows}) prompt={args.prompt_len}: "
        f"engine decode step {step_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms, "
        f"host on the critical path {step_ms - replay_ms:+.3f} ms"
    )
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time_total)
    total = sum(sum(v) for v in kernels.values())
    print(f"one step run eagerly: {sum(map(len, kernels.values()))} kernels, {total / 1e3:.3f} ms of device time")
    print("| kernel | launches | ms |\n|---|---|---|")
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[: args.rows]:
        print(f"| {name[:80]} | {len(times)} | {sum(times) / 1e3:.3f} |")
    return 0


# Innermost matching frame names the part an ATen op belongs to (a proxy for GPU kernel launches).
_OP_PARTS = (
    ("KV staging (PagedStepView)", "inference/kv_blocks.py", ("layer", "finish", "_stage", "__init__")),
    ("attention kv-cache op", "/ops/attention/", ("attention_with_kv_cache",)),
    ("model forward (rest)", "models/gpt.py", ("forward_packed",)),
    ("draw (_draw)", "inference/engine.py", ("_draw",)),
    ("pack (IsoBatch)", "models/batch.py", ("pack",)),
)


def _op_counts(run, nsteps: int) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}

    def part() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            for label, path, names in _OP_PARTS:
                if code.co_name in names and path in code.co_filename:
                    return label
            frame = frame.f_back
        return "engine (rest)"

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            label = part()
            counts[label] = counts.get(label, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        run("ops_")
    total = sum(counts.values())
    print(f"ATen ops per step (a proxy for GPU kernel launches; views included): {total / nsteps:.0f}")
    for label, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<30s} {n / nsteps:8.0f}")


if __name__ == "__main__":
    sys.exit(main())
