"""Where one phase of an RL step launches its torch ops: a count per source line of the package.

A profiler names kernels, not the code that launched them; a decode step of many small kernels (routing sorts,
gathers, index arithmetic) needs the line. This runs one warm RL step, then counts every non-view ATen op of the
next step's ``rollout`` or ``train_on`` phase under a ``TorchDispatchMode``, attributed to the innermost
``megatron_iso`` frame, and prints the lines with the most ops per generated token (rollout) or per step (train).
Triton kernels are not ATen ops and are not counted. On CUDA pass ``rollout.cuda_graphs=false``: a replayed graph
dispatches nothing.

    python3 tools/op_sites.py --model qwen3p5_small_hybrid_moe --phase rollout rollout.cuda_graphs=false
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import traceback
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no kernel (views, metadata, allocation without a fill).
NO_KERNEL = frozenset(
    [
        "view",
        "reshape",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "t",
        "alias",
        "expand",
        "permute",
        "transpose",
        "as_strided",
        "detach",
        "_unsafe_view",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "narrow",
        "lift_fresh",
        "_reshape_alias",
        "diagonal",
        "view_as_real",
        "view_as_complex",
        "unflatten",
        "flatten",
        "contiguous",
        "movedim",
        "empty",
        "empty_like",
        "empty_strided",
        "_local_scalar_dense",
        "is_same_size",
    ]
)


class OpSites(TorchDispatchMode):
    """Counts non-view ATen ops by the innermost package frame (``path:line``) and op name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL:
            frames = [f for f in traceback.extract_stack() if "megatron_iso" in f.filename]
            site = f"{frames[-1].filename.split('megatron_iso/')[-1]}:{frames[-1].lineno}" if frames else "-"
            self.counts[(site, name)] += 1
        return func(*args, **(kwargs or {}))


def count_phase(model: str, phase: str, new_tokens: int, overrides: list[str]) -> OpSites:
    """Op sites of ``phase`` in the second RL step of a small workload of ``model``."""
    from megatron_iso.parallel.world import seed_ranks
    from megatron_iso.rl.trainer import Trainer
    from megatron_iso.settings import config_world, resolve
    from megatron_iso.settings.compose import load_config

    sites = OpSites()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            [f"model={model}", "rl.group_size=4", f"rl.max_response_length={new_tokens}", "task.prompts_per_step=8",
             "task.prompt_len=64", f"out_dir={tmp}", *overrides]
        )  # fmt: skip
        with config_world(cfg) as rank:
            seed_ranks(int(cfg.seed))
            trainer = Trainer(resolve(cfg), rank)
            trainer.step(0)  # compiles, captures, allocates: not counted
            method = getattr(trainer, phase)

            def counted(*args, **kwargs):
                with sites:
                    return method(*args, **kwargs)

            setattr(trainer, phase, counted)
            trainer.step(1)
    return sites


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny_hybrid_moe")
    p.add_argument("--phase", choices=["rollout", "train_on"], default="rollout")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=50)
    p.add_argument("--out", type=Path, default=None, help="JSON of every (site, op) count")
    p.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = p.parse_args(argv)
    sites = count_phase(args.model, args.phase, args.new_tokens, args.overrides)
    per = args.new_tokens if args.phase == "rollout" else 1
    by_site: collections.Counter[str] = collections.Counter()
    for (site, _), n in sites.counts.items():
        by_site[site] += n
    unit = "generated token" if args.phase == "rollout" else "step"
    print(f"{sum(by_site.values()) / per:.1f} ATen ops per {unit} ({args.model}, {args.phase})")
    print(f"| ops per {unit} | site | top ops |\n|---|---|---|")
    for site, n in by_site.most_common(args.rows):
        ops = sorted(((op, c) for (s, op), c in sites.counts.items() if s == site), key=lambda x: -x[1])[:4]
        print(f"| {n / per:.1f} | {site} | {', '.join(f'{op} {c / per:.1f}' for op, c in ops)} |")
    if args.out:
        rows = [{"site": s, "op": op, "count": c} for (s, op), c in sites.counts.most_common()]
        args.out.write_text(json.dumps({"model": args.model, "phase": args.phase, "per": per, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
