"""Decode throughput: the bundled decoder in the correctness (iso) and performance (native) profiles
vs HF transformers ``generate``, all three on the same random seeded weights.

    python tools/bench_decode.py --model qwen3_0p6b --batch 1 8 64 256 --prompt-len 512 --new-tokens 512 \
        --max-seconds 40 --budget-seconds 500 --out bench_decode.json
    python tools/bench_decode.py --model tiny_dense --batch 1 4 --prompt-len 8 --new-tokens 8   # CPU

Every request generates exactly ``--new-tokens`` tokens (no stop ids; HF with ``eos_token_id=None``
and ``min_new_tokens``). Cells run batch-major (every engine at batch 1, then 8, ...) so the ratios
of the small batches exist even when the budget ends the run early. Each cell: a short warm-up
generate at the same batch and prompt length (Triton compiles per shape bucket), then one timed
generate, CUDA-synchronised. A timed run longer than ``--max-seconds`` stops there and reports what
it generated (note ``partial``); a cell that could not finish within ``--budget-seconds`` of the
start is skipped (note ``skipped``). Rows print as they complete; ``--out`` is rewritten after each.

``--profile-step``: afterwards one generate per engine at ``--profile-batch``, its decode steps
(after every prompt is prefilled) under torch.profiler, with a range per model module (layer index
as ``*``) and, for the decoder, per engine phase (forward, sample): prints the top ops by self CUDA
and self CPU time and the time of each part.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_iso.bench.profiling import module_ranges, print_summary, ranged, summarize
from megatron_iso.bench.provenance import code_identity

ENGINES = ("iso", "native", "hf")
PROFILES = {"iso": "correctness", "native": "performance"}
ISO_OVER_NATIVE_TARGET = 0.9  # target: iso >= 0.9x native tokens/s
NATIVE_OVER_HF_TARGET = (64, 3.0)  # target: native >= 3x HF generate at batch 64


@dataclass
class Run:
    generated: int
    wall_s: float
    ttft_s: float | None
    partial: bool


@dataclass
class Cell:
    engine: str
    batch: int
    prompt_len: int
    new_tokens: int
    wall_s: float | None = None
    generated: int = 0
    tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None  # tokens after each request's first / time after the last prefill
    ttft_s: float | None = None  # until every request of the batch has its first token
    warmup_s: float | None = None
    peak_gb: float | None = None
    graphs: str = ""  # the decoder's CUDA graphs: replays/captures of the timed run, or why they were off
    roofline_tokens_per_s: float | None = None  # decode tok/s if every step only read its bytes at copy bandwidth
    roofline_fraction: float | None = None  # decode_tokens_per_s / roofline_tokens_per_s
    note: str = ""


def step_bytes(model: torch.nn.Module, batch: int, context: float) -> float:
    """Bytes a decode step must read at least: every weight once (the input embedding only when it is not
    also the LM head: a step reads a handful of its rows; of an MoE layer's routed experts, the share that
    ``batch * top-k`` uniformly routed slots touch in expectation, ``1 - (1 - k / E) ** batch``) and the KV cache
    of ``batch`` sequences of ``context`` tokens (attention layers), plus each Gated DeltaNet layer's recurrent state
    (fp32 ``[Hv, Dk, Dv]`` per sequence) and conv window (``K - 1`` rows of the conv channels), each read and
    written once per step."""
    from megatron_iso.models.gdn import gdn_layer_indices

    mc = model.config
    emb = model.embedding.word_embeddings.weight
    touched = 1.0
    if mc.num_moe_experts:
        touched = 1.0 - (1.0 - mc.moe_router_topk / mc.num_moe_experts) ** batch
    weights = sum(
        p.numel() * p.element_size() * (touched if ".local_experts." in name else 1.0)
        for name, p in model.named_parameters()
    )
    if not getattr(model, "share_embeddings_and_output_weights", False):
        weights -= emb.numel() * emb.element_size()
    attn_layers = mc.num_layers - len(gdn_layer_indices(mc))
    kv_token = attn_layers * 2 * mc.num_query_groups * mc.kv_channels * emb.element_size()
    gdn_seq = 0
    gdn_layers = len(gdn_layer_indices(mc))
    if gdn_layers:
        tp = mc.tensor_model_parallel_size
        hk, hv = mc.linear_num_key_heads // tp, mc.linear_num_value_heads // tp
        dk, dv = mc.linear_key_head_dim, mc.linear_value_head_dim
        conv = (hk * dk * 2 + hv * dv) * (int(mc.linear_conv_kernel_dim) - 1) * emb.element_size()
        gdn_seq = gdn_layers * 2 * (hv * dk * dv * 4 + conv)  # read + write
    return weights + batch * context * kv_token + batch * gdn_seq


def copy_bandwidth() -> float | None:
    """Device copy bandwidth in bytes/s (read + write of a 2 GiB copy, best of 5); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del x, y
    return 2 * (1 << 31) / best


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


class EngineRunner:
    """The bundled decoder over one built model. A fresh engine (and KV cache sized for the run)
    per run: a run cut at its deadline leaves nothing behind, and no run gets prefix hits from an
    earlier one."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace) -> None:
        self.model = model
        self.args = args
        self.vocab = int(model.config.vocab_size)
        self.instrument = False  # profiler ranges around the engine's forward and sampler
        self.last_graphs = ""

    def _engine(self, batch: int, total_len: int):
        from megatron_iso.inference import EngineConfig, PagedKVCache, RolloutEngine

        mc, bs = self.model.config, self.args.block_size
        per = PagedKVCache.bytes_per_block(mc.num_layers, bs, mc.num_query_groups, mc.kv_channels, mc.params_dtype)
        # +2 blocks a sequence: the shared prompt prefill's partial block and its copy on write at the fork
        blocks = batch * (math.ceil(total_len / bs) + 2)
        config = EngineConfig(
            kv_cache_bytes=blocks * per,
            block_size=bs,
            max_num_seqs=batch,
            max_prefill_tokens=self.args.max_prefill_tokens,
            paged_kv_reads=not self.args.staged_kv,
            cuda_graphs=not self.args.no_cuda_graphs,
        )
        engine = RolloutEngine(self.model, config)
        if self.instrument:
            engine.forward_fn = ranged("engine: forward", engine.forward_fn)
            if engine.decode_graphs is not None:  # decode steps a bucket serves skip forward_fn
                graphs = engine.decode_graphs
                graphs.decode_step = ranged("engine: decode graph step", graphs.decode_step)
            engine._draw = ranged("engine: draw", engine._draw)  # no public hook; profiling only
        return engine

    def run(self, prompts: list[list[int]], new_tokens: int, max_seconds: float, on_prefilled=None) -> Run:
        from megatron_iso.inference import Request, SamplingParams

        engine = self._engine(len(prompts), len(prompts[0]) + new_tokens)
        params = SamplingParams(temperature=self.args.temperature, max_new_tokens=new_tokens, seed=self.args.seed)
        for i, p in enumerate(prompts):
            engine.add_request(Request(i, p, params))
        prompt_tokens, ttft, partial = sum(map(len, prompts)), None, False
        graphs = engine.decode_graphs
        if graphs is not None:
            graphs.warm(len(prompts), len(prompts[0]) + 1)  # capture before the clock, as a server at start-up
        _sync()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"request {out.request_id}: {out.error}")
            elapsed = time.perf_counter() - t0  # step() reads its tokens on the host: already synchronised
            s = engine.stats
            if ttft is None and s.prefill_tokens + s.prefix_hit_tokens >= prompt_tokens:
                ttft = elapsed  # a prompt's prefill step samples its first token
                if on_prefilled is not None:
                    on_prefilled()
            if max_seconds and elapsed > max_seconds and engine.has_unfinished():
                partial = True
                break
        _sync()
        wall = time.perf_counter() - t0
        self.last_graphs = engine.decode_graphs_status()
        return Run(engine.stats.generated_tokens, wall, ttft, partial)


class _FirstLogits:
    """A logits processor that notes when generate's first logits (the prefill's) are ready."""

    def __init__(self, on_prefilled=None) -> None:
        self.at: float | None = None
        self.on_prefilled = on_prefilled

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            _sync()
            self.at = time.perf_counter()
            if self.on_prefilled is not None:
                self.on_prefilled()
        return scores


class HFRunner:
    """transformers ``generate`` (dynamic KV cache, the default attention) with no early stop."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace) -> None:
        self.model = model
        self.args = args
        self.vocab = int(model.config.vocab_size)
        self.instrument = False

    def run(self, prompts: list[list[int]], new_tokens: int, max_seconds: float, on_prefilled=None) -> Run:
        from transformers import LogitsProcessorList

        ids = torch.tensor(prompts, device=self.model.device)
        t = self.args.temperature
        sampling = {"do_sample": True, "temperature": t, "top_k": 0, "top_p": 1.0} if t > 0 else {"do_sample": False}
        first = _FirstLogits(on_prefilled)
        torch.manual_seed(self.args.seed)
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                max_time=max_seconds or None,
                logits_processor=LogitsProcessorList([first]),
                **sampling,
            )
        _sync()
        wall = time.perf_counter() - t0
        per_row = out.shape[1] - ids.shape[1]
        return Run(per_row * ids.shape[0], wall, None if first.at is None else first.at - t0, per_row < new_tokens)


def build_runners(args: argparse.Namespace, failures: dict[str, str]) -> dict[str, EngineRunner | HFRunner]:
    """All engines' models on the same HF-named random weights (call inside the launched world)."""
    from omegaconf import OmegaConf

    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    base = load_config([f"model={args.model}", *args.overrides])
    if torch.cuda.is_available():  # refuse GEMM shapes the GPU kernels cannot walk before building anything
        from megatron_iso.settings import check_gpu_gemm_shapes

        check_gpu_gemm_shapes(base)
    hf_weights = random_hf_state_dict(transformer_config(base), seed=args.seed)
    runners: dict[str, EngineRunner | HFRunner] = {}
    for name in args.engines:
        try:
            if name == "hf":
                runners[name] = HFRunner(
                    _hf_model(OmegaConf.to_container(base.model, resolve=True), hf_weights, args), args
                )
            else:
                cfg = load_config([f"model={args.model}", f"profile={PROFILES[name]}", *args.overrides])
                runners[name] = EngineRunner(build_model(transformer_config(cfg), hf_weights).eval(), args)
        except Exception:  # keep the other engines; the traceback says what broke
            failures[f"build {name}"] = traceback.format_exc()
            print(failures[f"build {name}"], file=sys.stderr, flush=True)
    return runners


def _hf_model(model_cfg: dict, hf_weights: dict[str, torch.Tensor], args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    from megatron_iso.checkpoint.hf_config import hf_config_from_model

    hf = hf_config_from_model(model_cfg)
    config = getattr(transformers, f"{hf['architectures'][0].removesuffix('ForCausalLM')}Config")(
        **{k: v for k, v in hf.items() if k not in ("architectures", "model_type", "dtype")}
    )
    dtype = next(iter(hf_weights.values())).dtype
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with device:  # initialise on the GPU: the random init of a CPU copy of a real-sized model is slow
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.hf_attn, dtype=dtype)
    missing, unexpected = model.load_state_dict(hf_weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise KeyError(f"HF weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    return model.eval()


def run_cell(name: str, runner, batch: int, args: argparse.Namespace) -> Cell:
    cell = Cell(name, batch, args.prompt_len, args.new_tokens)
    # Distinct warm-up and timed prompts; the timed ones are the same for every engine.
    warm = _prompts(batch, args.prompt_len, runner.vocab, seed=args.seed + 2 * batch + 1)
    timed = _prompts(batch, args.prompt_len, runner.vocab, seed=args.seed + 2 * batch)
    t0 = time.perf_counter()
    runner.run(warm, min(args.warmup_new_tokens, args.new_tokens), args.max_seconds)
    cell.warmup_s = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = runner.run(timed, args.new_tokens, args.max_seconds)
    if torch.cuda.is_available():
        cell.peak_gb = torch.cuda.max_memory_allocated() / 2**30
    cell.wall_s, cell.generated, cell.ttft_s = run.wall_s, run.generated, run.ttft_s
    cell.graphs = getattr(runner, "last_graphs", "")
    cell.tokens_per_s = run.generated / run.wall_s
    if run.ttft_s is not None and run.wall_s > run.ttft_s and run.generated > batch:
        cell.decode_tokens_per_s = (run.generated - batch) / (run.wall_s - run.ttft_s)
    if run.partial:
        cell.note = f"partial: stopped at --max-seconds {args.max_seconds:g}"
    model = getattr(runner, "model", None)
    if args.copy_bw and model is not None and cell.decode_tokens_per_s is not None:
        # Mean context over the decode steps: the prompt plus half the generated tokens.
        decoded = cell.generated / batch
        need = step_bytes(model, batch, args.prompt_len + decoded / 2)
        cell.roofline_tokens_per_s = batch * args.copy_bw / need
        cell.roofline_fraction = cell.decode_tokens_per_s / cell.roofline_tokens_per_s
    return cell


def profile_step(name: str, runner, args: argparse.Namespace, warm: bool = True) -> dict:
    """Profile the decode steps of one generate (after a warm-up at the same batch unless ``warm`` is
    False): the profiler starts once every prompt is prefilled. Top ops by self CUDA and self CPU
    time, and the parts."""
    from torch.profiler import ProfilerActivity, profile

    batch, new = args.profile_batch, args.profile_new_tokens
    prompts = _prompts(batch, args.prompt_len, runner.vocab, seed=args.seed + 7919)
    if warm:
        runner.run(_prompts(batch, args.prompt_len, runner.vocab, seed=args.seed + 7920), 2, args.max_seconds)
    cuda = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    started: list[float] = []

    def begin() -> None:
        prof.start()
        started.append(time.perf_counter())

    runner.instrument = True
    try:
        with module_ranges(runner.model):
            run = runner.run(prompts, new, args.max_seconds, on_prefilled=begin)
    finally:
        runner.instrument = False
    if not started:
        raise RuntimeError(f"profile {name}: the prefill did not finish within --max-seconds {args.max_seconds:g}")
    _sync()
    decode_s = time.perf_counter() - started[0]
    prof.stop()
    return {
        "engine": name,
        "batch": batch,
        "prompt_len": args.prompt_len,
        "new_tokens": new,
        "decode_wall_s": decode_s,
        "decode_tokens": run.generated - batch,  # the first token of each request came with its prefill
        **summarize(prof, args.profile_rows, device=cuda),
    }


def print_profile(p: dict) -> None:
    busy = "" if p["device_busy_s"] is None else f"; kernels busy {p['device_busy_s']:.3f} s"
    print(f"\n### profile: {p['engine']}, batch {p['batch']}, decode steps after a {p['prompt_len']}-token prefill")
    print(f"decode {p['decode_wall_s']:.3f} s for {p['decode_tokens']} tokens (profiler on){busy}")
    print_summary(p)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


TABLE_HEADER = (
    "\n| engine | batch | prompt | new | wall s | tok/s | decode tok/s | roofline tok/s | of roofline | TTFT s "
    "| warm-up s | peak GB | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def print_row(c: Cell) -> None:
    print(
        f"| {c.engine} | {c.batch} | {c.prompt_len} | {c.new_tokens} | {_fmt(c.wall_s, '.3f')} | "
        f"{_fmt(c.tokens_per_s, '.1f')} | {_fmt(c.decode_tokens_per_s, '.1f')} | "
        f"{_fmt(c.roofline_tokens_per_s, '.0f')} | {_fmt(c.roofline_fraction, '.1%')} | {_fmt(c.ttft_s, '.3f')} | "
        f"{_fmt(c.warmup_s, '.2f')} | {_fmt(c.peak_gb, '.2f')} | {'; '.join(x for x in (c.graphs, c.note) if x)} |",
        flush=True,
    )


def ratios(cells: list[Cell]) -> list[dict]:
    """iso/native and native/HF tokens/s per batch, with the issue's targets."""
    by = {(c.engine, c.batch): c for c in cells if c.tokens_per_s}
    out = []
    for b in sorted({c.batch for c in cells}):
        row: dict = {"batch": b}
        for key, (num, den) in {"iso/native": ("iso", "native"), "native/hf": ("native", "hf")}.items():
            if (num, b) in by and (den, b) in by:
                row[key] = by[num, b].tokens_per_s / by[den, b].tokens_per_s
                row[key + " partial"] = bool(by[num, b].note or by[den, b].note)
        out.append(row)
    return out


def print_ratios(rows: list[dict]) -> None:
    hf_batch, hf_target = NATIVE_OVER_HF_TARGET
    print("\n| batch | iso/native | target | native/HF | target |\n|---|---|---|---|---|")
    for r in rows:
        iso, nat = r.get("iso/native"), r.get("native/hf")
        t1 = "" if iso is None else ("met" if iso >= ISO_OVER_NATIVE_TARGET else "missed")
        t2 = ""
        if nat is not None and r["batch"] == hf_batch:
            t2 = "met" if nat >= hf_target else "missed"
        star1 = "*" if r.get("iso/native partial") else ""
        star2 = "*" if r.get("native/hf partial") else ""
        print(
            f"| {r['batch']} | {_fmt(iso, '.3f')}{star1} | >= {ISO_OVER_NATIVE_TARGET} {t1} | "
            f"{_fmt(nat, '.2f')}{star2} | {f'>= {hf_target:g} {t2}' if r['batch'] == hf_batch else '-'} |"
        )
    if any(r.get("iso/native partial") or r.get("native/hf partial") for r in rows):
        print("(* from a partial run)")
    sys.stdout.flush()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny_dense", help="conf/model name (qwen3_0p6b on the GPU)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--warmup-new-tokens", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16, help="KV block size of the decoder")
    p.add_argument(
        "--staged-kv",
        action="store_true",
        help="iso: stage each layer's KV history instead of "
        "reading the paged pool in place (EngineConfig.paged_kv_reads=False; same bits)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="iso/native decoder: run decode steps eagerly (EngineConfig.cuda_graphs=False; same bits)",
    )
    p.add_argument("--max-prefill-tokens", type=int, default=4096, help="decoder prompt tokens admitted per step")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop a timed run after this long (0: never)")
    p.add_argument("--budget-seconds", type=float, default=0.0, help="skip cells that would end later (0: none)")
    p.add_argument("--profile-step", action="store_true", help="profile one generate per engine afterwards")
    p.add_argument("--profile-batch", type=int, default=64)
    p.add_argument("--profile-new-tokens", type=int, default=16)
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("bench_decode.json"))
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = p.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "warmup_new_tokens", "profile_batch", "profile_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; allowed: an int >= 1")
    if min(args.batch) < 1:
        p.error(f"--batch {args.batch} is invalid; allowed: ints >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    from megatron_iso.parallel.world import launched_world

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    cells: list[Cell] = []
    profiles: list[dict] = []
    failures: dict[str, str] = {}

    args.copy_bw = copy_bandwidth()
    meta = {"device": device, "torch": torch.__version__, "transformers": _version("transformers"), **code_identity()}
    meta["copy_bandwidth_gbs"] = None if args.copy_bw is None else args.copy_bw / 1e9

    def save() -> None:
        report = {"model": args.model, **meta, "args": vars(args) | {"out": str(args.out)}}
        report |= {"cells": [asdict(c) for c in cells], "ratios": ratios(cells), "profiles": profiles}
        args.out.write_text(json.dumps(report | {"failures": failures}, indent=1))

    def over_budget() -> bool:
        # a cell is a warm-up and a timed run, each cut at --max-seconds (plus the step under way)
        left = args.budget_seconds - (time.perf_counter() - start)
        return bool(args.budget_seconds) and left < 2 * args.max_seconds

    def measure(name: str, runner, batch: int) -> Cell:
        if over_budget():
            return Cell(name, batch, args.prompt_len, args.new_tokens, note="skipped: --budget-seconds")
        try:
            return run_cell(name, runner, batch, args)
        except torch.OutOfMemoryError:
            return Cell(name, batch, args.prompt_len, args.new_tokens, note="out of memory")
        except Exception:  # keep the other cells; the traceback says what broke
            failures[f"{name} batch {batch}"] = traceback.format_exc()
            print(failures[f"{name} batch {batch}"], file=sys.stderr, flush=True)
            return Cell(name, batch, args.prompt_len, args.new_tokens, note="error (see failures)")
        finally:
            gc.collect()  # the run's engine and KV cache

    def profile(name: str, runner, warm: bool) -> None:
        if over_budget():
            print(f"profile {name}: skipped (--budget-seconds)", flush=True)
            return
        try:
            profiles.append(profile_step(name, runner, args, warm=warm))
            print_profile(profiles[-1])
        except Exception:
            failures[f"profile {name}"] = traceback.format_exc()
            print(failures[f"profile {name}"], file=sys.stderr, flush=True)
        save()

    with launched_world(seed=args.seed):
        runners = build_runners(args, failures)
        bw = "" if args.copy_bw is None else f"; copy bandwidth {args.copy_bw / 1e9:.0f} GB/s (the roofline's)"
        print(f"\n{args.model} on {device}: prompt {args.prompt_len}, {args.new_tokens} new tokens, "
              f"temperature {args.temperature:g}; build {time.perf_counter() - start:.1f} s{bw}")  # fmt: skip
        for batch in args.batch:
            print(TABLE_HEADER, flush=True)
            for name, runner in runners.items():
                cells.append(measure(name, runner, batch))
                print_row(cells[-1])
                save()
                # Profiled right after its cell (already warm), before larger batches can use up the budget.
                if args.profile_step and batch == args.profile_batch:
                    profile(name, runner, warm=cells[-1].tokens_per_s is None)
        print_ratios(ratios(cells))
        if args.profile_step and args.profile_batch not in args.batch:
            for name, runner in runners.items():
                profile(name, runner, warm=True)
    save()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
