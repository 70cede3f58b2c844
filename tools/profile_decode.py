"""Profile rollout generation (the bundled decoder) with torch.profiler and print the top ops.

python tools/profile_decode.py --model qwen3_0p6b --profile correctness --prompts 8 --group 8 --new-tokens 8
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_dense")
    parser.add_argument("--profile", default="correctness")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args(argv)

    from megatron_iso.config import load_config
    from megatron_iso.inference.engine import EngineConfig, RolloutEngine
    from megatron_iso.inference.params import Request, SamplingParams
    from megatron_iso.models.config import transformer_config
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.parallel.world import launched_world

    cfg = load_config([f"model={args.model}", f"profile={args.profile}"])
    with launched_world(seed=0):
        tc = transformer_config(cfg)
        model = build_model(tc, random_hf_state_dict(tc, seed=0)).eval()
        engine = RolloutEngine(model, EngineConfig(kv_cache_bytes=4 << 30))
        params = SamplingParams(max_new_tokens=args.new_tokens, n=args.group, seed=0)
        prompts = [
            torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(args.prompts)
        ]
        with torch.no_grad():
            engine.generate([Request(f"warm{i}", p, params) for i, p in enumerate(prompts)])
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
