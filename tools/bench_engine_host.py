"""The rollout engine's host work per step, with the model's forward and draw stubbed out: no device needed.

A decode step's wall time is the device's work (the captured graph) plus whatever the host does between graph
launches: admission, the draw plan, the step's input tables, reading the drawn tokens back, recording them. This
tool runs the engine on the CPU with decode steps from its static bucket buffers (``enable_decode_graphs(
capture=False)``: the same host code as a captured decode) while the forward returns a preallocated logits buffer
and the draw returns preallocated tokens, so what it times is the engine's Python and its host-side tensor
bookkeeping alone. Beside ``bench_decode.py``'s step and graph-replay columns on a GPU it says which side a decode
step waits on.

    python tools/bench_engine_host.py --model qwen3p5_small_hybrid_moe --batch 32 --prompt-len 4096 --new-tokens 64
    python tools/bench_engine_host.py --model tiny_dense --batch 8 --prompt-len 16 --new-tokens 16   # quick

Prints one table row per batch size (median / p90 host milliseconds per decode step) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _stubbed_engine(model: torch.nn.Module, batch: int, total_len: int, block_size: int):
    """An engine over ``model`` whose forward and draw cost nothing: logits from one preallocated buffer, tokens and
    logprobs from another (token 0: no request finishes early, every step decodes the whole batch)."""
    from megatron_iso.inference import EngineConfig, PagedKVCache, RolloutEngine

    mc = model.config
    per = PagedKVCache.bytes_per_block(mc.num_layers, block_size, mc.num_query_groups, mc.kv_channels, mc.params_dtype)
    blocks = batch * (-(-total_len // block_size) + 2)
    config = EngineConfig(
        kv_cache_bytes=blocks * per, block_size=block_size, max_num_seqs=batch, max_prefill_tokens=1 << 30
    )
    engine = RolloutEngine(model, config)
    vocab = int(getattr(mc, "padded_vocab_size", 0) or mc.vocab_size)
    row = torch.zeros(1, vocab)

    def forward(ids: torch.Tensor, batch_: object) -> torch.Tensor:
        return row.expand(ids.numel(), vocab)  # a view: a long prefill allocates nothing

    model.forward_packed = forward
    engine.forward_fn = forward
    graphs = engine.enable_decode_graphs(capture=False)
    if graphs.drawer is not None:
        tokens, logprobs = torch.zeros(batch, dtype=torch.long), torch.zeros(batch)
        graphs.drawer.plain = lambda lg, *_: (tokens[: lg.shape[0]], logprobs[: lg.shape[0]])
    return engine


def host_step_ms(model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, block_size: int) -> dict:
    """Milliseconds of host work per engine step over one generate of ``batch`` requests (decode steps: every step
    after the first, which prefills)."""
    from megatron_iso.inference import Request, SamplingParams

    engine = _stubbed_engine(model, batch, prompt_len + new_tokens, block_size)
    params = SamplingParams(max_new_tokens=new_tokens, seed=1, temperature=1.0)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(Request(i, torch.randint(0, 100, (prompt_len,), generator=g).tolist(), params))
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id}: {out.error}")
        steps.append((time.perf_counter() - t0) * 1e3)
    decode = sorted(steps[1:]) or [float("nan")]
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "prefill_step_ms": steps[0],
        "decode_steps": len(decode),
        "decode_step_ms_median": decode[len(decode) // 2],
        "decode_step_ms_p90": decode[int(len(decode) * 0.9)],
        "bucket_steps": engine.decode_graphs.steps,  # decode steps served from the bucket buffers, as on a GPU
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny_dense", help="conf/model name")
    ap.add_argument("--batch", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench_engine_host.json"))
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args(argv)

    from megatron_iso.bench.provenance import code_identity
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.parallel.world import single_process_world
    from megatron_iso.settings.compose import load_config

    rows = []
    with single_process_world():
        tc = transformer_config(load_config([f"model={args.model}", "device=cpu", *args.overrides]))
        model = build_model(tc, random_hf_state_dict(tc, seed=0)).eval()
        print(
            "\n| model | batch | prompt | new | decode steps | host ms / step (median) | p90 |\n|---|---|---|---|---|---|---|"
        )
        for b in args.batch:
            r = host_step_ms(model, b, args.prompt_len, args.new_tokens, args.block_size)
            rows.append(r)
            print(f"| {args.model} | {b} | {args.prompt_len} | {args.new_tokens} | {r['decode_steps']} | "
                  f"{r['decode_step_ms_median']:.2f} | {r['decode_step_ms_p90']:.2f} |", flush=True)  # fmt: skip
    report = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "command": " ".join(sys.argv), **code_identity()}
    args.out.write_text(json.dumps(report | {"rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
