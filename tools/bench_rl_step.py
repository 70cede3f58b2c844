"""Time full RL steps (generation, training, total) and measure rollout-vs-trainer mismatch for
the correctness (iso) and performance (native) profiles side by side, in one process.

    python tools/bench_rl_step.py --model qwen3_0p6b --steps 4 --prompts 16 --group 8 --new-tokens 64 \
        --out rl_step.json

Step 0 of each profile is a warm-up (Triton compiles, allocator growth) and is excluded from the
timing means. Prints a markdown table; writes every step's metrics to ``--out``.

Multi-GPU: under ``torchrun --nproc-per-node N`` with ``parallel.tp=N`` (and ``parallel.sp=true``)
every rank runs its share on ``cuda:<LOCAL_RANK>`` over NCCL; rank 0 prints and writes ``--out``.

    torchrun --nproc-per-node 2 tools/bench_rl_step.py --model qwen3_0p6b --out rl_step_tp2.json parallel.tp=2

``--train-micro-batch-seqs N``: the trainer's forward/backward over N sequences at a time per rank
(``rl.train_micro_batch_seqs``, both profiles; recorded under ``args`` in the JSON): bounds the training
step's memory (logits and activations of N sequences, not of all).

``--profile-step K``: step K of each profile runs under torch.profiler with a range per phase
(``rl: rollout``, ``rl: train``, ``rl: publish``) and per model module (forward only; the backward's
ops appear by name): top ops by self CUDA / CPU time and the parts, printed and in the JSON. That
step's timings include the profiler's overhead and are left out of the means. ``--profile-phase
train`` (or ``rollout``) records only that phase of the step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_iso.bench.profiling import module_ranges, print_summary, ranged, summarize
from megatron_iso.bench.provenance import code_identity

# torchrun's rank (0 without torchrun): rank 0 alone prints and writes; every rank runs every step.
RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


PHASES = {"rollout": "rl: rollout", "train_on": "rl: train", "publish_weights": "rl: publish"}
PROFILE_PHASES = {"step": None, "rollout": "rollout", "train": "train_on"}


def _profiled_step(trainer, step: int, rows: int, phase: str = "step") -> tuple[dict, dict]:
    """One trainer step with torch.profiler recording the whole step (``phase="step"``) or only one phase
    (``"rollout"``, ``"train"``), with phase and module ranges."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    only = PROFILE_PHASES[phase]
    for attr, label in PHASES.items():
        method = ranged(label, getattr(trainer, attr))
        if attr == only:
            method = _inside(prof, method, cuda)
        setattr(trainer, attr, method)
    try:
        with module_ranges(trainer.model):
            if only is None:
                with prof:
                    metrics = trainer.step(step)
                    if cuda:
                        torch.cuda.synchronize()
            else:
                metrics = trainer.step(step)
    finally:
        for attr in PHASES:
            delattr(trainer, attr)  # back to the class's methods
    return metrics, summarize(prof, rows, device=cuda)


def _inside(prof, method, cuda: bool):
    def run(*args, **kwargs):
        with prof:
            out = method(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        return out

    return run


BF16_DENSE_PEAK = 989e12  # H100/H200 SXM bf16 dense tensor-core peak, FLOP/s


def train_model_flops(model, n_seq: int, seq_len: int) -> float:
    """Model FLOPs of one training pass (forward + backward) over ``n_seq`` sequences of ``seq_len`` tokens:
    6 N T for the matmul weights (N without the input embedding's lookup; routed experts counted at
    top-k of E, the active share) plus causal attention's 6 L^2 d H per full-attention layer and sequence.
    Per rank: with tensor parallelism the weights and heads are this rank's shards."""
    from megatron_iso.models.gdn import gdn_layer_indices

    tc = model.config
    experts = tc.num_moe_experts or 0
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "word_embeddings" in name:
            continue
        share = tc.moe_router_topk / experts if experts and ".experts." in name else 1.0
        active += p.numel() * share
    tokens = n_seq * seq_len
    attn_layers = tc.num_layers - len(gdn_layer_indices(tc))
    heads = tc.num_attention_heads // tc.tensor_model_parallel_size  # this rank's heads, as its weights are its shards
    attention = 6 * seq_len**2 * tc.kv_channels * heads * attn_layers * n_seq
    return 6 * active * tokens + attention


def _config(profile: str, args: argparse.Namespace, out_dir: str):
    from megatron_iso.checkpoint.init_from import apply_init_from
    from megatron_iso.settings.compose import load_config

    # model.init_from=DIR (an HF directory or a megatron_iso checkpoint) replaces the model group's shapes and
    # random weights with the checkpoint's, as in iso-train.
    cfg = load_config(
        [
            f"model={args.model}",
            f"profile={profile}",
            f"rl.group_size={args.group}",
            f"rl.max_response_length={args.new_tokens}",
            f"task.prompts_per_step={args.prompts}",
            f"task.prompt_len={args.prompt_len}",
            f"rollout.kv_cache_mb={args.kv_cache_mb}",
            f"rl.train_micro_batch_seqs={args.train_micro_batch_seqs}",
            f"out_dir={out_dir}",
            *args.overrides,
        ]
    )
    return apply_init_from(cfg, args.overrides)


def _layout() -> dict[str, int]:
    """The running world's size and Megatron layout: what the timings were measured on."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def run_profile(profile: str, args: argparse.Namespace) -> dict:
    from megatron_iso.parallel.world import seed_ranks
    from megatron_iso.rl.trainer import Trainer
    from megatron_iso.settings import config_world, resolve

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(profile, args, tmp)
        # Inside main's world (its layout checked against this config's); seeded afresh so each
        # profile starts from the state a world of its own would give it.
        with config_world(cfg) as rank:
            seed_ranks(int(cfg.seed))
            layout = _layout()
            t0 = time.perf_counter()
            trainer = Trainer(resolve(cfg), rank)
            build_s = time.perf_counter() - t0
            flops = train_model_flops(trainer.model, args.prompts * args.group, args.prompt_len + args.new_tokens)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            steps, profiled = [], None
            for step in range(args.steps):
                if step == args.profile_step:
                    metrics, profiled = _profiled_step(trainer, step, args.profile_rows, args.profile_phase)
                    if rank == 0:
                        print(f"\n### profile: {profile}, step {step}, {args.profile_phase}")
                        print_summary(profiled)
                else:
                    metrics = trainer.step(step)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                steps.append(metrics)
                if rank == 0:
                    line = json.dumps({k: round(v, 6) for k, v in metrics.items()})
                    print(f"[{profile}] step {step}: {line}", flush=True)
            decode_graphs = trainer.engine.decode_graphs_status()
            del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    timed = [s for i, s in enumerate(steps) if i > 0 and i != args.profile_step] or steps

    def mean(key: str) -> float:
        return sum(s[key] for s in timed) / len(timed)

    return {
        "profile": profile,
        **layout,
        "build_s": build_s,
        "train_model_flops": flops,
        "train_mfu": flops / mean("timing/train_s") / BF16_DENSE_PEAK,
        "gen_s": mean("timing/gen_s"),
        "train_s": mean("timing/train_s"),
        "step_s": mean("timing/step_s"),
        "gen_tokens_per_s": mean("throughput/gen_tokens_per_s"),
        "peak_memory_gb": max(s["memory/peak_bytes"] for s in steps) / 2**30,
        "mismatch_max": max(s.get("mismatch/abs_diff_max", 0.0) for s in steps),
        "mismatch_mean": mean("mismatch/abs_diff_mean") if "mismatch/abs_diff_mean" in timed[0] else 0.0,
        "bitwise_equal_frac": min(s.get("mismatch/bitwise_equal_frac", 1.0) for s in steps),
        "decode_graphs": decode_graphs,  # the rollout's CUDA graphs over all steps, or why they were off
        "steps": steps,
        "profile_summary": profiled,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_dense")
    parser.add_argument("--profiles", nargs="+", default=["correctness", "performance"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument(
        "--train-micro-batch-seqs", type=int, default=0,
        help="sequences per trainer micro-batch on each rank, both profiles (rl.train_micro_batch_seqs; 0: all in one)",
    )  # fmt: skip
    parser.add_argument("--profile-step", type=int, default=-1, help="profile this step (-1: none)")
    parser.add_argument(
        "--profile-phase", choices=sorted(PROFILE_PHASES), default="step",
        help="what the profiled step records: the whole step, or only its rollout or its training",
    )  # fmt: skip
    parser.add_argument("--profile-rows", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("rl_step.json"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args(argv)
    from megatron_iso.settings import config_world

    results, failures = [], {}
    # One world for every profile: the config's layout (parallel.tp/pp/ep; under torchrun each rank
    # on cuda:<LOCAL_RANK> over NCCL). torchrun's rendezvous store cannot host a second world in the
    # same processes (the re-init finds the first world's stale addresses).
    with config_world(_config(args.profiles[0], args, tempfile.gettempdir())):
        for profile in args.profiles:
            try:
                results.append(run_profile(profile, args))
            except Exception:  # keep the other profile's numbers; the traceback says what broke
                import traceback

                failures[profile] = traceback.format_exc()
                print(f"[rank {RANK}] {failures[profile]}", file=sys.stderr, flush=True)
                if WORLD_SIZE > 1:
                    raise  # the other ranks may wait in a collective: exit so torchrun stops them all
    if RANK != 0:
        return 0
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if WORLD_SIZE > 1:
        device = f"{WORLD_SIZE} x {device}"
    micro = f", trainer micro-batches of {args.train_micro_batch_seqs}" if args.train_micro_batch_seqs else ""
    print(
        f"\n{args.model} on {device}: {args.prompts} prompts x {args.group} samples, {args.new_tokens} new tokens{micro}"
    )
    print("| profile | gen s | train s | train MFU | step s | gen tok/s | peak GB | max abs dlogp | bitwise frac |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['profile']} | {r['gen_s']:.3f} | {r['train_s']:.3f} | {r['train_mfu']:.1%} | {r['step_s']:.3f} "
            f"| {r['gen_tokens_per_s']:.0f} | {r['peak_memory_gb']:.2f} | {r['mismatch_max']:.3e} "
            f"| {r['bitwise_equal_frac']:.3f} |"
        )
    for r in results:
        print(f"decode graphs, {r['profile']}: {r['decode_graphs']}")
    by = {r["profile"]: r for r in results}
    if {"correctness", "performance"} <= by.keys():
        ratio = by["correctness"]["step_s"] / by["performance"]["step_s"]
        print(f"iso/native full step time: {ratio:.3f}")
    args.out.write_text(json.dumps({"model": args.model, "device": device, **code_identity(),
                                    "args": vars(args) | {"out": str(args.out)},
                                    "results": results, "failures": failures}, indent=1))  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
