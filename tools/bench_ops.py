"""Check and time the Triton (GPU) correctness-profile ops against their stock baselines.

Every run checks before it times: batch invariance (row 0 bitwise across M), the TP-subtree
identity of the leaf tree, and that the M-dependent schedule never changes a bit. Then it times the
leaf-tree GEMM against cuBLAS (``x @ w.t()``) and the memory-bound ops against the copy bandwidth
measured in the same run. All timings are CUDA-graph replays (``triton.testing.do_bench_cudagraph``,
median), so launch overhead of the Python wrappers is not what is measured: decode runs under graphs.

    python tools/bench_ops.py --out bench.json            # full table (M x N x K grid)
    python tools/bench_ops.py --sweep --out sweep.json    # tile/park variants of the G=8 GEMM
    python tools/bench_ops.py --tiles --attention --skip-gemm --skip-mem   # tile equivalence, attention
    python tools/bench_ops.py --decode-tiles --skip-gemm --skip-mem        # tiles of the models' decode GEMMs
    python tools/bench_ops.py --attention-split --skip-gemm --skip-mem     # batch-1 decode: split vs unsplit
    python tools/bench_ops.py --attention-backward-sweep --skip-gemm --skip-mem   # backward tile candidates
    python tools/bench_ops.py --moe --skip-gemm --skip-mem --out moe.json  # grouped expert GEMM (Qwen3-30B-A3B)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from typing import Any

import torch

MS = (1, 16, 64, 256, 1024, 4096, 16384)
# (N, K) of Qwen3-8B's linears: attention output and MLP down (row-parallel, the 8-leaf tree), fused QKV and
# gate/up (column-parallel, one leaf).
NKS = ((4096, 4096), (4096, 12288), (6144, 4096), (24576, 4096))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


def _time_ms(fn, rep: int = 40) -> float:
    import triton.testing

    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def _time_events_ms(fn, rep: int = 40) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, rep=rep, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written, in GB/s."""
    n = 1 << 29
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    # Events around 20 plain copies (no graph): a graph-replayed copy reads low (2.8 of 4.3 TB/s on an H200).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    ms = min(start.elapsed_time(end) / 20, _time_ms(lambda: dst.copy_(src), rep=200))
    return 2 * n * 4 / ms / 1e6


def _rand(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)


# ---------------------------------------------------------------- GEMM
def gemm_checks(leaves_list=(1, 2, 8), dtype=torch.bfloat16, config=None) -> dict[str, Any]:
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as f

    out: dict[str, Any] = {}
    N, K = 1024, 4096
    w = _rand((N, K), dtype, 1)
    x = _rand((2048, K), dtype, 2)
    for G in leaves_list:
        full = f(x, w, G, config=config)
        ok_rows = all(_bits_equal(f(x[:m], w, G, config=config)[0], full[0]) for m in (1, 2, 3, 7, 8, 64, 1000))
        perm = torch.randperm(x.shape[0], device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
        ok_perm = _bits_equal(f(x[perm], w, G, config=config), full[perm])
        ok_sched = all(
            _bits_equal(f(x[:64], w, G, parallel=p, config=config), full[:64]) for p in (1, 2, 4, 8) if p <= G
        )
        ref = (x.double() @ w.double().t()).float()
        rel = float((full - ref).norm() / ref.norm())
        rec = {"row0_bitwise_M": ok_rows, "permutation_bitwise": ok_perm, "schedule_bitwise": ok_sched, "rel_err": rel}
        if G >= 2:
            h = K // 2
            halves = f(x[:, :h], w[:, :h], G // 2, config=config) + f(x[:, h:], w[:, h:], G // 2, config=config)
            rec["tp2_halves_bitwise"] = _bits_equal(halves, full)
        out[f"G{G}"] = rec
    return out


def _gemm_time(M, N, K, G, dtype=torch.bfloat16, parallel=None, config=None, same_as=None):
    """(ms, registers, spills) of one leaf-tree GEMM launch; with ``same_as`` (a config) also whether its output
    has that config's bits on the same inputs."""
    from megatron_iso.ops.gemm import gemm_triton as gt

    x = _rand((M, K), dtype, 10)
    w = _rand((N, K), dtype, 11)
    fn = lambda: gt.leaf_tree_linear_triton(x, w, G, parallel=parallel, config=config)  # noqa: E731
    out = fn()
    ck = gt.LAST_COMPILED
    regs = getattr(ck, "n_regs", None)
    spills = getattr(ck, "n_spills", None)
    ms = _time_ms(fn)
    if same_as is None:
        return ms, regs, spills
    return ms, regs, spills, _bits_equal(out, gt.leaf_tree_linear_triton(x, w, G, parallel=1, config=same_as))


def _cublas_ms(M, N, K, dtype=torch.bfloat16):
    x = _rand((M, K), dtype, 10)
    w = _rand((N, K), dtype, 11)
    return _time_ms(lambda: x @ w.t())


def gemm_sweep(small_m: bool = True) -> list[dict[str, Any]]:
    """The shipped large-M tiles of the 8-leaf and one-leaf GEMM, the pointer-loop tiles they fall back to, and loop /
    tile candidates beside them (bits against the shipped tile), at the Qwen3-8B row-parallel shapes; schedules at
    small M."""
    from megatron_iso.ops.gemm import gemm_triton as gt
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C

    # Candidates beside the shipped tiles (select_config's: the descriptor loops, and the pointer loops they fall
    # back to where operands cannot take TMA descriptors), by leaves per program.
    variants = {
        8: {
            "t_128x128_w8_s4_p1": C(128, 128, 64, 8, 4, park_from=1, loop="tma"),
            "g_128x256_w8_s3_p0": C(128, 256, 64, 8, 3, park_from=0, loop="gluon"),  # p1: s0 spills at 128 x 256
            "g_64x128_w4_s4_p1": C(64, 128, 64, 4, 4, park_from=1, loop="gluon"),  # two programs per SM
        },
        1: {
            "t_128x256_w8_s3_g1": C(128, 256, 64, 8, 3, park_from=0, loop="tma"),
            "g_128x256_w8_s4_g1": C(128, 256, 64, 8, 4, park_from=0, loop="gluon"),
            # the 8-leaf shipped tile at one leaf: its mainloop's rate without leaf ends
            "g_128x128_w8_s4_g1": C(128, 128, 64, 8, 4, park_from=0, loop="gluon"),
            # the shipped TMA tile with other rasterisation groups (L2 reuse of the weight tiles)
            "t_128x256_w8_s4_gm4_g1": C(128, 256, 64, 8, 4, group_m=4, loop="tma"),
            "t_128x256_w8_s4_gm16_g1": C(128, 256, 64, 8, 4, group_m=16, loop="tma"),
        },
    }
    rows = []
    shapes = [
        (4096, 4096, 4096),
        (16384, 4096, 4096),
        (4096, 4096, 12288),
        (16384, 4096, 12288),
    ]  # Qwen3-8B row-parallel
    for M, N, K in shapes:
        cub = _cublas_ms(M, N, K)
        tf = lambda ms, M=M, N=N, K=K: 2 * M * N * K / ms / 1e9  # noqa: E731
        print(f"cuBLAS {M}x{N}x{K}: {tf(cub):.0f} TFLOP/s", flush=True)
        runs = []
        for G, candidates in variants.items():
            shipped = gt.select_config(torch.bfloat16, M, G, N, descriptor_loops=True)
            pointer = gt.select_config(torch.bfloat16, M, G, N)
            named = {f"shipped_g{G}": shipped, f"pointer_fallback_g{G}": pointer, **candidates}
            runs += [(name, cfg, G, shipped) for name, cfg in named.items()]
        for name, cfg, G, reference in runs:
            try:
                ms, regs, spills, same = _gemm_time(M, N, K, G, config=cfg, parallel=1, same_as=reference)
            except Exception as exc:  # a variant that does not compile is a result too
                rows.append({"variant": name, "M": M, "N": N, "K": K, "G": G, "error": repr(exc)[:300]})
                print(f"  {name} G={G}: ERROR {exc!r}"[:200], flush=True)
                continue
            r = {"variant": name, "M": M, "N": N, "K": K, "G": G, "ms": ms, "tflops": tf(ms), "ratio": cub / ms,
                 "regs": regs, "spills": spills, "cublas_tflops": tf(cub), "same_bits_as_shipped": same}  # fmt: skip
            rows.append(r)
            print(f"  {name} G={G}: {tf(ms):.0f} TFLOP/s  {cub / ms:.2f}x  regs={regs} spills={spills} "
                  f"same bits {same}", flush=True)  # fmt: skip
    # small M: schedules (programs per tile) of the default config
    for N, K in NKS if small_m else ():
        for M in (1, 16, 64, 256):
            cub = _cublas_ms(M, N, K)
            for G in (8,):
                for p in (1, 2, 4, 8):
                    ms, regs, spills = _gemm_time(M, N, K, G, parallel=p)
                    rows.append({"variant": f"default_par{p}", "M": M, "N": N, "K": K, "G": G, "ms": ms,
                                 "ratio": cub / ms, "cublas_ms": cub})  # fmt: skip
                    print(f"  M={M} N={N} K={K} G={G} par={p}: {ms * 1e3:.1f}us  {cub / ms:.2f}x", flush=True)
    return rows


def gemm_table(leaves_list=(1, 2, 8)) -> list[dict[str, Any]]:
    rows = []
    for N, K in NKS:
        for M in MS:
            cub = _cublas_ms(M, N, K)
            flop = 2 * M * N * K
            r: dict[str, Any] = {"M": M, "N": N, "K": K, "cublas_tflops": flop / cub / 1e9, "cublas_ms": cub}
            for G in leaves_list:
                ms, _regs, spills = _gemm_time(M, N, K, G)
                r[f"G{G}_tflops"] = flop / ms / 1e9
                r[f"G{G}_ratio"] = cub / ms
                r[f"G{G}_spills"] = spills
            rows.append(r)
            print(
                f"{M:>6} {N:>5} {K:>6} cuBLAS {r['cublas_tflops']:7.1f} | "
                + " ".join(f"G{G} {r[f'G{G}_tflops']:7.1f} ({r[f'G{G}_ratio']:.2f}x)" for G in leaves_list),
                flush=True,
            )
    return rows


def gemm_tile_equivalence() -> dict[str, Any]:
    """Do tiles with the same BLOCK_K give the same bits? (the proof behind ``select_config``).

    Every config is compared with the per-dtype default on the same inputs, G = 1 and 8, bf16 and fp32.
    Configs with another BLOCK_K are included as information (not claimed).
    """
    from megatron_iso.ops.gemm.gemm_triton import CONFIGS
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as f

    variants = {
        torch.bfloat16: {
            "128x256x64_w8_s3": C(128, 256, 64, 8, 3), "128x256x64_w8_s2": C(128, 256, 64, 8, 2),
            "64x64x64_w4_s4": C(64, 64, 64, 4, 4), "64x32x64_w4_s6": C(64, 32, 64, 4, 6),
            "64x128x64_w4_s4": C(64, 128, 64, 4, 4), "128x64x64_w4_s4": C(128, 64, 64, 4, 4),
            "128x128x64_w4_s3_static": C(128, 128, 64, 4, 3, loop="static"),
            "32x64x64_w4_s4(mma v2?)": C(32, 64, 64, 4, 4), "16x64x64_w4_s4(mma v2?)": C(16, 64, 64, 4, 4),
            "64x64x64_w2_s4": C(64, 64, 64, 2, 4),
            "128x128x32_w8_s4(other BK)": C(128, 128, 32, 8, 4), "128x128x128_w8_s2(other BK)": C(128, 128, 128, 8, 2),
        },
        torch.float32: {
            "128x64x32_w4_s3": C(128, 64, 32, 4, 3, loop="static"), "64x128x32_w8_s2": C(64, 128, 32, 8, 2, loop="static"),
            "32x32x32_w4_s4": C(32, 32, 32, 4, 4, loop="static"), "64x64x32_w4_s3_flat": C(64, 64, 32, 4, 3),
            "64x64x16_w4_s3(other BK)": C(64, 64, 16, 4, 3, loop="static"),
        },
    }  # fmt: skip
    res: dict[str, Any] = {}
    for dtype, cfgs in variants.items():
        x = _rand((300, 2048), dtype, 51)
        w = _rand((640, 2048), dtype, 52)
        for G in (1, 8):
            base = f(x, w, G, parallel=1, config=CONFIGS[dtype])
            for name, cfg in cfgs.items():
                key = f"{str(dtype).removeprefix('torch.')}_G{G}_{name}"
                if G > 1 and cfg.block_n >= 256 and cfg.num_stages > 2:
                    continue  # does not fit shared memory with the 8-leaf park buffer
                try:
                    out = f(x, w, G, parallel=1, config=cfg)
                    res[key] = _bits_equal(out, base)
                    if not res[key]:
                        res[key + "_max_abs_diff"] = float((out - base).abs().max())
                except Exception as exc:
                    res[key] = f"error: {exc!r}"[:200]
    print("tile equivalence:", json.dumps(res, indent=1), flush=True)
    return res


def gemm_candidates() -> list[dict[str, Any]]:
    """G = 1 tile candidates per M bucket (decode-sized M and large M), against cuBLAS."""
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C

    small = {"64x64_w4_s4": C(64, 64, 64, 4, 4), "64x32_w4_s6": C(64, 32, 64, 4, 6),
             "64x64_w4_s6": C(64, 64, 64, 4, 6), "64x128_w4_s4": C(64, 128, 64, 4, 4),
             "64x32_w4_s4": C(64, 32, 64, 4, 4)}  # fmt: skip
    large = {"128x256_w8_s3": C(128, 256, 64, 8, 3), "128x128_w8_s4": C(128, 128, 64, 8, 4),
             "128x128_w4_s4": C(128, 128, 64, 4, 4)}  # fmt: skip
    rows = []
    for N, K in NKS:
        for M, cfgs in ((1, small), (16, small), (64, small), (256, {**small, **large}), (4096, large)):
            cub = _cublas_ms(M, N, K)
            for G in (1, 8):
                for name, cfg in cfgs.items():
                    try:
                        ms, _regs, spills = _gemm_time(M, N, K, G, config=cfg)
                    except Exception as exc:
                        rows.append({"M": M, "N": N, "K": K, "G": G, "cfg": name, "error": repr(exc)[:200]})
                        continue
                    rows.append({"M": M, "N": N, "K": K, "G": G, "cfg": name, "ratio": cub / ms, "ms": ms,
                                 "spills": spills})  # fmt: skip
                    print(f"cand M={M} N={N} K={K} G={G} {name}: {cub / ms:.2f}x of cuBLAS", flush=True)
    return rows


# Decode-sized GEMMs of the bundled models: (model, linear, M, N, K, leaves). Qwen3-0.6B at batch 1, Qwen3-8B at
# batch 64; column-parallel layers (QKV, gate/up, LM head) run one leaf, row-parallel ones (out, down) eight.
DECODE_GEMMS = (
    ("qwen3_0p6b", "qkv", 1, 4096, 1024, 1), ("qwen3_0p6b", "out", 1, 1024, 2048, 8),
    ("qwen3_0p6b", "gate_up", 1, 6144, 1024, 1), ("qwen3_0p6b", "down", 1, 1024, 3072, 8),
    ("qwen3_0p6b", "lm_head", 1, 151936, 1024, 1),
    ("qwen3_8b", "qkv", 64, 6144, 4096, 1), ("qwen3_8b", "out", 64, 4096, 4096, 8),
    ("qwen3_8b", "gate_up", 64, 24576, 4096, 1), ("qwen3_8b", "down", 64, 4096, 12288, 8),
    ("qwen3_8b", "lm_head", 64, 151936, 4096, 1),
)  # fmt: skip


def decode_tile_sweep() -> list[dict[str, Any]]:
    """Every 16- and 64-row candidate tile (and, for 8 leaves, programs per tile) on the decode GEMMs above: its bits
    against the default tile's, its time against cuBLAS and against the tile ``select_config`` picks."""
    from megatron_iso.ops.gemm import gemm_triton as gt
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C

    cands = {
        f"{bm}x{bn}_w{w}_s{st}": C(bm, bn, 64, w, st)
        for bm in (16, 64)
        for bn in (16, 32, 64, 128)
        for w in ((2, 4) if bm == 16 else (4,))
        for st in (4, 8)
    }
    rows: list[dict[str, Any]] = []
    for model, name, M, N, K, G in DECODE_GEMMS:
        x, w = _rand((M, K), torch.bfloat16, 1), _rand((N, K), torch.bfloat16, 2)
        base = gt.leaf_tree_linear_triton(x, w, G, parallel=1, config=gt.CONFIGS[torch.bfloat16])
        cub = _time_ms(lambda x=x, w=w: x @ w.t())
        picked = _time_ms(lambda x=x, w=w, G=G: gt.leaf_tree_linear_triton(x, w, G))
        head = {"model": model, "linear": name, "M": M, "N": N, "K": K, "G": G, "cublas_us": cub * 1e3}
        rows.append({**head, "cfg": "selected", "us": picked * 1e3, "ratio": cub / picked})
        best = None
        for cname, cfg in cands.items():
            for par in (None,) if G == 1 else (None, 1, 8):
                try:
                    ok = _bits_equal(gt.leaf_tree_linear_triton(x, w, G, parallel=par, config=cfg), base)
                    ms = _time_ms(
                        lambda x=x, w=w, G=G, par=par, cfg=cfg: gt.leaf_tree_linear_triton(
                            x, w, G, parallel=par, config=cfg
                        )
                    )
                except Exception as exc:  # a candidate that does not compile is a result too
                    rows.append({**head, "cfg": cname, "parallel": par, "error": repr(exc)[:200]})
                    continue
                rows.append({**head, "cfg": cname, "parallel": par, "us": ms * 1e3, "bits": ok, "ratio": cub / ms})
                if not ok:
                    print(f"  {model} {name} {cname} parallel={par}: BITS DIFFER", flush=True)
                elif best is None or ms < best[0]:
                    best = (ms, cname, par)
        print(
            f"{model} {name} M={M} N={N} K={K} G={G}: cuBLAS {cub * 1e3:.1f} us, selected {picked * 1e3:.1f} us"
            + (f", best {best[1]} (parallel {best[2]}) {best[0] * 1e3:.1f} us" if best else ""),
            flush=True,
        )
    return rows


# ---------------------------------------------------------------- MoE experts (grouped GEMM)
# Qwen3-30B-A3B experts: hidden 2048, moe_ffn_hidden 768 (fc1 packs gate|up: N = 1536), 128 experts, top-8.
MOE_E, MOE_TOPK, MOE_H, MOE_F = 128, 8, 2048, 768
MOE_TOKENS = (64, 512, 4096, 16384)


def moe_counts(tokens: int, experts: int = MOE_E, topk: int = MOE_TOPK, seed: int = 0, skew: float = 0.6) -> list[int]:
    """Rows per expert for ``tokens`` tokens routed top-k (k distinct experts per token) with a skewed,
    Zipf-like expert popularity (weight rank**-skew, ranks in a seeded random order): a few hot
    experts, a long tail, empty experts at small T. skew=0.6: the hottest expert gets ~7x the mean."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, experts + 1, dtype=torch.float64) ** -skew
    popularity = popularity[torch.randperm(experts, generator=g)]
    chosen = torch.multinomial(popularity.expand(tokens, experts), topk, replacement=False, generator=g)
    return torch.bincount(chosen.reshape(-1), minlength=experts).tolist()


def moe_bench(tokens_list=MOE_TOKENS, fc2_leaves=(1, 4, 8)) -> list[dict[str, Any]]:
    """Grouped leaf-tree GEMM vs a cuBLAS per-expert loop (``x_e @ w_e.t()``, bf16) vs the per-expert
    leaf-tree loop (today's IsoSequentialExperts path before the grouped kernel), at Qwen3-30B-A3B expert
    shapes; torch's grouped mm (``torch._grouped_mm``, stacked weights) where this torch has it.

    Checked in the same run: grouped == per-expert leaf-tree loop bit for bit, and the error of both
    against an fp32 GEMM of the same bf16 inputs. All timed calls are CUDA-graph replays: the per-expert
    loops' slicing happens on the host at capture, the grouped kernel reads the counts on the device.
    """
    rows_out: list[dict[str, Any]] = []
    for name, K, N, leaves_list in (("fc1", MOE_H, 2 * MOE_F, (1,)), ("fc2", MOE_F, MOE_H, tuple(fc2_leaves))):
        rows_out += _moe_one_gemm(name, K, N, leaves_list, tokens_list)
        torch.cuda.empty_cache()
    return rows_out


def _moe_one_gemm(name: str, K: int, N: int, leaves_list, tokens_list) -> list[dict[str, Any]]:
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as dense
    from megatron_iso.ops.gemm.grouped_triton import grouped_config
    from megatron_iso.ops.gemm.grouped_triton import grouped_leaf_tree_linear_triton as grouped

    dt = torch.bfloat16
    rows_out = []
    # Separate tensors per expert, as Megatron's SequentialMLP keeps them (the grouped kernel copies none).
    ws = [_rand((N, K), dt, 1000 + e) / K**0.5 for e in range(MOE_E)]
    stacked = torch.stack(ws)  # only for torch._grouped_mm
    for tokens in tokens_list:
        counts = moe_counts(tokens)
        T = sum(counts)
        x = _rand((T, K), dt, 2000 + tokens)
        counts_dev = torch.tensor(counts, device="cuda")
        spans, start = [], 0
        for e, c in enumerate(counts):
            if c:
                spans.append((e, x[start : start + c]))
            start += c
        flop = 2 * T * N * K
        base: dict[str, Any] = {"gemm": name, "tokens": tokens, "rows": T, "N": N, "K": K,
                                "experts_nonempty": len(spans), "max_rows": max(counts),
                                "min_rows": min(counts)}  # fmt: skip
        cublas = lambda spans=spans: [xe @ ws[e].t() for e, xe in spans]  # noqa: E731
        base["cublas_loop_ms"] = _time_ms(cublas)
        try:
            offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
            gmm = lambda x=x, offs=offs: torch._grouped_mm(x, stacked.transpose(-2, -1), offs=offs)  # noqa: E731
            base["torch_grouped_mm_ms"] = _time_ms(gmm)
        except Exception as exc:  # torch without _grouped_mm, or a device it does not support
            base["torch_grouped_mm_ms"] = None
            base["torch_grouped_mm_error"] = repr(exc)[:200]
        with torch.no_grad():
            ref = torch.cat([xe.float() @ ws[e].float().t() for e, xe in spans])
        for G in leaves_list:
            r = dict(base, leaves=G)
            try:
                out = grouped(x, ws, counts_dev, G)
                loop = torch.cat([dense(xe, ws[e], G) for e, xe in spans])
                r["grouped_eq_leaf_tree_loop_bitwise"] = _bits_equal(out, loop)
                r["grouped_rel_err_vs_fp32"] = float((out - ref).norm() / ref.norm())
                r["cublas_rel_err_vs_fp32"] = float(
                    (torch.cat([t.float() for t in cublas()]) - ref).norm() / ref.norm()
                )
                r["grouped_tile"] = dataclasses.asdict(grouped_config(dt, T, MOE_E, G))
                r["grouped_ms"] = _time_ms(lambda x=x, G=G, c=counts_dev: grouped(x, ws, c, G))
                r["leaf_tree_loop_ms"] = _time_ms(lambda spans=spans, G=G: [dense(xe, ws[e], G) for e, xe in spans])
            except Exception as exc:  # e.g. a leaf depth that is not a multiple of BLOCK_K: a result too
                r["error"] = repr(exc)[:300]
                rows_out.append(r)
                print(f"moe {name} T={tokens} G={G}: ERROR {r['error']}", flush=True)
                continue
            for key in ("cublas_loop", "torch_grouped_mm", "grouped", "leaf_tree_loop"):
                ms = r.get(f"{key}_ms")
                r[f"{key}_tflops"] = flop / ms / 1e9 if ms else None
            r["grouped_vs_cublas_loop"] = r["cublas_loop_ms"] / r["grouped_ms"]
            r["grouped_vs_leaf_tree_loop"] = r["leaf_tree_loop_ms"] / r["grouped_ms"]
            rows_out.append(r)
            gmm_txt = f"{r['torch_grouped_mm_ms'] * 1e3:8.1f}" if r["torch_grouped_mm_ms"] else "     n/a"
            print(
                f"moe {name} T={tokens:>5} rows={T:>6} G={G}: grouped {r['grouped_ms'] * 1e3:8.1f} us "
                f"({r['grouped_tflops']:5.0f} TF/s) | cuBLAS loop {r['cublas_loop_ms'] * 1e3:8.1f} us "
                f"({r['grouped_vs_cublas_loop']:.2f}x) | leaf-tree loop {r['leaf_tree_loop_ms'] * 1e3:8.1f} us "
                f"({r['grouped_vs_leaf_tree_loop']:.2f}x) | torch grouped_mm {gmm_txt} us | "
                f"bitwise={r['grouped_eq_leaf_tree_loop_bitwise']} rel={r['grouped_rel_err_vs_fp32']:.1e}",
                flush=True,
            )
    return rows_out


# ---------------------------------------------------------------- attention
# (rows, warps, stages, park): training tiles timed beside the shipped one (attention_bench's prefill rows). The
# shipped tile parks the running accumulator in fp32 scratch between merges (2 stages: 112 KB of shared memory, two
# programs per SM). Unparked, the 64-row, 4-warp tile keeps a segment's and the running accumulator live (64 x 128
# fp32 each) and spills; 8 warps per 64 rows do not spill; parked at 3 stages a program takes 144 KB, one per SM.
PREFILL_TILE_CANDIDATES = ((64, 4, 3, False), (64, 8, 3, False), (64, 4, 3, True))


def attention_checks() -> dict[str, Any]:
    from megatron_iso.ops.attention import attention_triton as at
    from megatron_iso.ops.attention.forward_launch_triton import AttentionTileConfig as AC

    res: dict[str, Any] = {}
    g = torch.Generator(device="cuda").manual_seed(60)
    L = 300
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(L, h, 128, device="cuda", generator=g).to(dtype) for h in (32, 8, 8))
        train = at.attention_varlen(q, k, v, torch.tensor([0, L]))
        kc = torch.full((2, L, 8, 128), float("nan"), device="cuda", dtype=dtype)
        vc = kc.clone()
        outs = [at.attention_with_kv_cache(q[:65], k[:65], v[:65], kc, vc, torch.tensor([0]), torch.tensor([0, 65]),
                                           slots=torch.tensor([1]))]  # fmt: skip
        for t in range(65, L):
            outs.append(at.attention_with_kv_cache(q[t : t + 1], k[t : t + 1], v[t : t + 1], kc, vc,
                                                   torch.tensor([t]), torch.tensor([0, 1]), slots=torch.tensor([1])))  # fmt: skip
        name = str(dtype).removeprefix("torch.")
        res[f"prefill65_decode_eq_varlen_{name}"] = _bits_equal(torch.cat(outs), train)
        # information: is BLOCK_M part of the arithmetic? (not claimed; the config is fixed)
        for cfg in (AC(64, 4, 2), AC(128, 4, 2), AC(128, 8, 2)):
            res[f"tile_{cfg.block_m}_{cfg.num_warps}_{cfg.num_stages}_eq_default_{name}"] = _bits_equal(
                at.attention_varlen(q, k, v, torch.tensor([0, L]), config=cfg), train
            )
    print("attention checks:", res, flush=True)
    return res


def attention_bench() -> list[dict[str, Any]]:
    """Qwen3-8B attention (32 q heads, 8 kv heads, d=128, bf16): prefill (varlen) and decode vs torch SDPA."""
    import torch.nn.functional as F

    from megatron_iso.ops.attention import attention_triton as at
    from megatron_iso.ops.attention import forward_launch_triton as launch

    candidates = [launch.AttentionTileConfig(*shape) for shape in PREFILL_TILE_CANDIDATES]
    rows = []
    hq, hkv, d = 32, 8, 128
    dt = torch.bfloat16
    scale = d**-0.5
    for n_seq, L in ((1, 8192), (4, 2048), (16, 512)):
        T = n_seq * L
        q, k, v = (_rand((T, h, d), dt, 70 + i) for i, h in enumerate((hq, hkv, hkv)))
        cu = [i * L for i in range(n_seq + 1)]
        call, out = launch.prepare(q, k, v, None, cu, [0] * n_seq, cu[:-1], scale, 64, None)
        ms = _time_ms(call)
        flop = 4 * n_seq * hq * d * L * L / 2
        # Candidate tiles timed beside the shipped one; the tile config (park included) moves no bit, checked.
        tried = []
        for cfg in candidates:
            call_c, out_c = launch.prepare(q, k, v, None, cu, [0] * n_seq, cu[:-1], scale, 64, cfg)
            ms_c = _time_ms(call_c)
            tried.append({"tile": dataclasses.astuple(cfg), "ms": ms_c, "tflops": flop / ms_c / 1e9,
                          "same_bits": _bits_equal(out_c, out)})  # fmt: skip
            del out_c
        # Longer segments (another arithmetic: a tuning candidate for the contract's SEG_BLOCKS, not a schedule):
        # fewer merges of the running accumulator per key, against the split decode's finer grain
        # (attention_decode_split_rows times that side).
        longer = []
        for seg in (4, 8):
            call_s, _ = launch.prepare(q, k, v, None, cu, [0] * n_seq, cu[:-1], scale, 64, None, seg_blocks=seg)
            ms_s = _time_ms(call_s)
            longer.append({"seg_blocks": seg, "ms": ms_s, "tflops": flop / ms_s / 1e9})
        qs, ks, vs = (t.view(n_seq, L, -1, d).transpose(1, 2) for t in (q, k, v))
        sdpa = functools.partial(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True, enable_gqa=True)
        ms_sdpa = _time_ms(sdpa)
        r = {"case": "prefill", "n_seq": n_seq, "L": L, "tile": dataclasses.astuple(launch.CONFIGS[dt]),
             "ms": ms, "tflops": flop / ms / 1e9, "sdpa_ms": ms_sdpa, "sdpa_tflops": flop / ms_sdpa / 1e9,
             "ratio_to_sdpa": ms_sdpa / ms, "candidates": tried, "longer_segments": longer}  # fmt: skip
        rows.append(r)
        cands = ", ".join(f"{c['tile']}: {c['tflops']:.0f} (same bits {c['same_bits']})" for c in tried)
        segs = ", ".join(f"{x['seg_blocks']} blocks {x['tflops']:.0f}" for x in longer)
        print(f"attn prefill {n_seq}x{L}: ours {r['tflops']:.0f} TFLOP/s (tile {r['tile']}); {cands}; segments of "
              f"{segs}; sdpa {r['sdpa_tflops']:.0f} ({r['ratio_to_sdpa']:.2f}x)", flush=True)  # fmt: skip
    for B, L in ((1, 4096), (32, 4096), (128, 2048), (8, 32768)):
        kc = _rand((B, L + 1, hkv, d), dt, 80)
        vc = _rand((B, L + 1, hkv, d), dt, 81)
        q = _rand((B, hq, d), dt, 82)
        cu = list(range(B + 1))
        call, _ = launch.prepare(q, kc.view(-1, hkv, d), vc.view(-1, hkv, d), None, cu, [L] * B,
                                 [i * (L + 1) for i in range(B)], scale, 64, None)  # fmt: skip
        ms = _time_ms(call)
        kn, vn = _rand((B, hkv, d), dt, 83), _rand((B, hkv, d), dt, 84)
        wrapper = functools.partial(
            at.attention_with_kv_cache, q, kn, vn, kc, vc, torch.full((B,), L), torch.arange(B + 1)
        )
        ms_wrap = _time_events_ms(wrapper)
        qs = q.view(B, 1, hq, d).transpose(1, 2)
        ks, vs = kc.transpose(1, 2), vc.transpose(1, 2)
        ms_sdpa = _time_ms(functools.partial(F.scaled_dot_product_attention, qs, ks, vs, enable_gqa=True))
        nbytes = 2 * B * (L + 1) * hkv * d * 2
        r = {"case": "decode", "B": B, "L": L, "kernel_ms": ms, "wrapper_ms": ms_wrap, "sdpa_ms": ms_sdpa,
             "GBps": nbytes / ms / 1e6, "sdpa_GBps": nbytes / ms_sdpa / 1e6, "ratio_to_sdpa": ms_sdpa / ms}  # fmt: skip
        rows.append(r)
        print(f"attn decode B={B} L={L}: kernel {ms * 1e3:.1f} us ({r['GBps']:.0f} GB/s), wrapper {ms_wrap * 1e3:.1f} us, "
              f"sdpa {ms_sdpa * 1e3:.1f} us ({r['sdpa_GBps']:.0f} GB/s)", flush=True)  # fmt: skip
    rows += attention_decode_split_rows()
    return rows


def attention_decode_split_rows() -> list[dict[str, Any]]:
    """Decode at Qwen3-0.6B heads (16 q, 8 kv, d=128, bf16), batch 1 and 16: the one-launch schedule (8 or 128
    programs walk every key block) vs the split over key segments, with the key capacity tight and at a decode
    graph's static 32k (most segment programs then find no segment); at batch 1 for segments of 2 kv blocks (the
    contract's) and 4 and 8 (tuning candidates: another size is another arithmetic). ``auto_splits``: what the
    auto schedule takes at the 32k capacity. Bits of split == unsplit checked for each row."""
    from megatron_iso.ops.attention import forward_launch_triton as launch
    from megatron_iso.ops.common.sm_count import sm_count

    rows = []
    hq, hkv, d = 16, 8, 128
    dt = torch.bfloat16
    sms = sm_count(torch.device("cuda"))
    for B in (1, 16):
        for L in (640, 4096):
            k_src, v_src = (_rand((B * (L + 1), hkv, d), dt, 85 + i) for i in range(2))
            q = _rand((B, hq, d), dt, 87)
            nbytes = 2 * B * (L + 1) * hkv * d * 2
            for seg in (launch.SEG_BLOCKS, 4, 8) if B == 1 else (launch.SEG_BLOCKS,):
                r: dict[str, Any] = {"case": "decode_split", "B": B, "L": L, "heads": [hq, hkv, d], "seg_blocks": seg}
                segments = -(-32768 // (seg * 64))
                r["auto_splits"] = (
                    launch.split_schedule(B * hkv, segments, True, sms, None, B * hq * segments * (d + 2) * 4) > 0
                )
                runs = {}
                for name, split, capacity in (
                    ("unsplit", False, None),
                    ("split", True, None),
                    ("split_32k", True, 32768),
                ):
                    call, out = launch.prepare(q, k_src, v_src, None, list(range(B + 1)), [L] * B,
                                               [i * (L + 1) for i in range(B)], d**-0.5, 64, None,
                                               kv_capacity=capacity, split=split, seg_blocks=seg)  # fmt: skip
                    r[f"{name}_us"] = _time_ms(call) * 1e3
                    runs[name] = out
                r["split_eq_unsplit"] = _bits_equal(runs["split"], runs["unsplit"])
                r["split_32k_eq_unsplit"] = _bits_equal(runs["split_32k"], runs["unsplit"])
                r["split_GBps"] = nbytes / r["split_us"] / 1e3
                rows.append(r)
                print(f"attn decode B={B} L={L} Qwen3-0.6B heads, segments of {seg} blocks: unsplit "
                      f"{r['unsplit_us']:.1f} us, split {r['split_us']:.1f} us ({r['split_GBps']:.0f} GB/s), split at "
                      f"32k capacity {r['split_32k_us']:.1f} us (auto splits: {r['auto_splits']}); same bits: "
                      f"{r['split_eq_unsplit']}/{r['split_32k_eq_unsplit']}", flush=True)  # fmt: skip
    return rows


BACKWARD_HEADS = (32, 8, 128)  # Qwen3-8B: query heads, kv heads, head dim


def _attention_backward_cases():
    """The backward benchmarks' inputs at ``BACKWARD_HEADS``, bf16: for each workload (16 x 768, 4 x 2048, 1 x 8192
    packed sequences) ``(n_seq, L, q, k, v, upstream gradient, cu_seqlens as a list, cu_seqlens)``."""
    hq, hkv, d = BACKWARD_HEADS
    for n_seq, L in ((16, 768), (4, 2048), (1, 8192)):
        T = n_seq * L
        q, k, v = (_rand((T, h, d), torch.bfloat16, 90 + i) for i, h in enumerate((hq, hkv, hkv)))
        g = _rand((T, hq, d), torch.bfloat16, 95)
        cu_list = [i * L for i in range(n_seq + 1)]
        yield n_seq, L, q, k, v, g, cu_list, torch.tensor(cu_list, device="cuda")


def attention_backward_bench() -> list[dict[str, Any]]:
    """Training attention backward at Qwen3-8B heads (32 q, 8 kv, d=128, bf16, causal, packed sequences):
    the Triton kernels vs the plain fp32 formula they replace vs SDPA's backward (not deterministic)."""
    import torch.nn.functional as F

    from megatron_iso.ops.attention import autograd as attn_autograd
    from megatron_iso.ops.attention.backward_triton import attention_backward

    rows = []
    hq, _, d = BACKWARD_HEADS
    scale = d**-0.5
    for n_seq, L, q, k, v, g, cu_list, cu in _attention_backward_cases():
        runs = [attention_backward(q, k, v, g, cu, L, scale) for _ in range(2)]
        same = all(_bits_equal(a, b) for a, b in zip(runs[0][:3], runs[1][:3], strict=True))
        ms = _time_events_ms(functools.partial(attention_backward, q, k, v, g, cu, L, scale), rep=10)
        plain_ms = None
        if n_seq * hq * L * L * 4 <= 2 << 30:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attn_autograd._plain_varlen(*leaves, cu_list, scale, None)
            plain_ms = _time_events_ms(
                functools.partial(torch.autograd.grad, out, leaves, g.float(), retain_graph=True), rep=5
            )
        qs, ks, vs = (t.view(n_seq, L, -1, d).transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        gs = g.view(n_seq, L, hq, d).transpose(1, 2)
        sdpa_ms = _time_events_ms(
            functools.partial(torch.autograd.grad, out, (qs, ks, vs), gs, retain_graph=True), rep=10
        )
        flop = 2.5 * 4 * n_seq * hq * d * L * L / 2
        r = {"n_seq": n_seq, "L": L, "ms": ms, "tflops": flop / ms / 1e9, "deterministic": same,
             "plain_fp32_ms": plain_ms, "sdpa_ms": sdpa_ms, "ratio_to_sdpa": sdpa_ms / ms}  # fmt: skip
        rows.append(r)
        plain = f"{plain_ms:.2f} ms" if plain_ms is not None else "skipped (memory)"
        print(f"attn backward {n_seq}x{L}: ours {ms:.2f} ms ({r['tflops']:.0f} TFLOP/s, same bits twice: {same}), "
              f"plain fp32 {plain}, sdpa {sdpa_ms:.2f} ms ({r['ratio_to_sdpa']:.2f}x)", flush=True)  # fmt: skip
    return rows


def attention_backward_sweep() -> list[dict[str, Any]]:
    """Tile candidates of the three backward kernels at Qwen3-8B heads (bf16, causal, packed): each kernel's
    candidates in turn with the other two at the shipped tiles, the whole backward timed; every candidate's
    gradients checked for the same bits on a second call and against the shipped tiles' within bf16 rounding (a
    tile changes the rounding, not the function)."""
    from megatron_iso.ops.attention.backward_triton import BackwardTile as T
    from megatron_iso.ops.attention.backward_triton import attention_backward, backward_tiles

    candidates = {  # the 64 x 64 tiles shipped before, the shipped ones, and neighbours of both
        "stats": [T(64, 64, 4, 2), T(128, 64, 8, 2), T(128, 64, 8, 3), T(128, 128, 8, 2), T(256, 64, 8, 2)],
        "dkdv": [T(64, 64, 8, 2), T(128, 64, 8, 2), T(128, 64, 4, 2), T(128, 128, 8, 2), T(64, 128, 8, 3)],
        "dq": [T(64, 64, 4, 2), T(128, 64, 8, 2), T(128, 64, 8, 3), T(64, 128, 4, 3), T(256, 64, 8, 2)],
    }  # fmt: skip
    rows = []
    d = BACKWARD_HEADS[2]
    scale = d**-0.5
    shipped = backward_tiles(torch.bfloat16, d)
    for n_seq, L, q, k, v, g, _, cu in _attention_backward_cases():
        base = attention_backward(q, k, v, g, cu, L, scale, tiles=shipped)
        for kernel, tiles in candidates.items():
            for tile in tiles:
                cfg = dataclasses.replace(shipped, **{kernel: tile})
                r: dict[str, Any] = {"n_seq": n_seq, "L": L, "kernel": kernel, "tile": dataclasses.asdict(tile)}
                try:
                    runs = [attention_backward(q, k, v, g, cu, L, scale, tiles=cfg) for _ in range(2)]
                except Exception as exc:  # a tile past the shared memory: recorded, the sweep goes on
                    r["error"] = repr(exc)[:300]
                    rows.append(r)
                    print(f"attn bwd sweep {n_seq}x{L} {kernel} {tile}: {r['error'][:120]}", flush=True)
                    continue
                r["deterministic"] = all(_bits_equal(a, b) for a, b in zip(runs[0][:3], runs[1][:3], strict=True))
                pairs = zip(runs[0][:3], base[:3], strict=True)
                r["rel_to_shipped"] = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in pairs)
                r["ms"] = _time_events_ms(
                    functools.partial(attention_backward, q, k, v, g, cu, L, scale, tiles=cfg), rep=30
                )
                rows.append(r)
                t = tile
                print(f"attn bwd sweep {n_seq}x{L} {kernel} {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}: "
                      f"{r['ms']:.2f} ms, deterministic {r['deterministic']}, rel to shipped "
                      f"{r['rel_to_shipped']:.1e}", flush=True)  # fmt: skip
    return rows


# ---------------------------------------------------------------- memory-bound ops
def norm_bench(bw: float) -> dict[str, Any]:
    try:
        from megatron_iso.ops.norm.norm_triton import gated_rms_norm_triton, rms_norm_triton
    except ImportError as exc:
        return {"skipped": repr(exc)}
    res: dict[str, Any] = {}
    for T, H in ((16384, 4096), (65536, 2048), (1, 4096), (8192, 8192)):
        x = _rand((T, H), torch.bfloat16, 20)
        w = _rand((H,), torch.bfloat16, 21)
        z = _rand((T, H), torch.bfloat16, 22)
        for name, fn, nbytes in (
            ("plain", lambda x=x, w=w: rms_norm_triton(x, w, 1e-6), 2 * T * H * 2),
            ("gated", lambda x=x, w=w, z=z: gated_rms_norm_triton(x, z, w, 1e-6), 3 * T * H * 2),
        ):
            ms = _time_ms(fn)
            gbs = nbytes / ms / 1e6
            res[f"{name}_{T}x{H}"] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw}
            print(f"rmsnorm {name} {T}x{H}: {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs / bw:.2f} of copy)", flush=True)
        full = rms_norm_triton(x, w, 1e-6)
        res[f"row0_bitwise_{T}x{H}"] = all(_bits_equal(rms_norm_triton(x[:m], w, 1e-6)[0], full[0]) for m in (1, 3, 7))
    return res


def logprob_bench(bw: float) -> dict[str, Any]:
    """The scoring kernel (CUDA correctness profile: one read of the logits per token logprob) against copy
    bandwidth and the torch leaf-tree reference it replaced; row 0's bits at other batch sizes and TP splits."""
    try:
        from megatron_iso.ops.logprob import LocalShards, VocabScores, host_checked_temperature
        from megatron_iso.ops.logprob.logprob_triton import TritonScores, vocab_parallel_check
    except ImportError as exc:
        return {"skipped": repr(exc)}

    temps: dict[tuple[int, float], torch.Tensor] = {}

    def score(lg: torch.Tensor, tgt: torch.Tensor, t: float = 0.7, cls=TritonScores) -> torch.Tensor:
        # A host-checked per-row temperature and ids_in_range: no host reads, so the call is graph-timed as the
        # decode step replays it (event timing of a small call measures Python, not the GPU).
        rows = lg.shape[0]
        if (rows, t) not in temps:
            host = torch.full((rows, 1), t)
            temps[rows, t] = host_checked_temperature(host.to(lg.device), host)
        scores = cls(lg.unsqueeze(0), LocalShards(1), temperature=temps[rows, t], leaves=8)
        return scores.token_logprobs(tgt, ids_in_range=True)

    res: dict[str, Any] = {}
    for T, V in ((4096, 151936), (256, 151936), (64, 151936), (1, 151936), (16384, 32768)):
        logits = _rand((T, V), torch.bfloat16, 30) * 4
        tgt = torch.randint(0, V, (T,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(31))
        for dt in (torch.bfloat16, torch.float32):
            lg = logits.to(dt)
            # t = 1 (the usual RL sampling temperature) skips the division per logit; t = 0.7 does not.
            for t in (1.0, 0.7):
                score(lg, tgt, t)  # compiles, and makes the rows' temperature outside the captured call
                ms = _time_ms(lambda lg=lg, tgt=tgt, t=t: score(lg, tgt, t))
                ref_ms = _time_ms(lambda lg=lg, tgt=tgt, t=t: score(lg, tgt, t, VocabScores))
                gbs = lg.numel() * lg.element_size() / ms / 1e6
                res[f"{dt}_{T}x{V}_t{t}"] = {
                    "ms": ms,
                    "GBps": gbs,
                    "of_copy_bw": gbs / bw,
                    "torch_reference_ms": ref_ms,
                }
                print(
                    f"logprob {dt} {T}x{V} t={t}: {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs / bw:.2f} of copy); "
                    f"torch leaf-tree reference {ref_ms * 1e3:.1f} us",
                    flush=True,
                )
        if T >= 4096:
            res[f"reciprocal_{T}x{V}"] = _reciprocal_division_rows(logits, tgt, score, bw)
        else:
            res[f"kernel_warps_{T}x{V}"] = _small_batch_warps_rows(logits)
        full = score(logits, tgt)
        res[f"row0_bitwise_{T}x{V}"] = all(_bits_equal(score(logits[:m], tgt[:m])[0], full[0]) for m in (1, 3))
        res[f"tp2_bitwise_{T}x{V}"] = vocab_parallel_check(logits, tgt, 0.7, 8, 2)
    return res


def _small_batch_warps_rows(logits: torch.Tensor) -> dict[str, Any]:
    """The scoring kernel alone at a decode batch (graph-timed), one program per (row, leaf) at 1, 2 and 4 warps, at
    t = 1 and t = 0.7 (a tensor temperature: div_rn, as the decode graphs run it; a number: the reciprocal form):
    a few programs walking 19 slices each are latency bound, and more warps shorten each slice. Bits compared
    with 1 warp (the warp count is a schedule choice); ``chosen``: the launch's default (``leaf_kernel_warps``)."""
    from megatron_iso.ops.logprob.logprob_triton import launch_leaf_kernel, leaf_kernel_warps
    from megatron_iso.ops.logprob.temperature_triton import division_args

    rows, vocab = logits.shape
    x = logits.unsqueeze(0)
    out: dict[str, Any] = {"chosen": leaf_kernel_warps(rows)}
    for t, form in ((1.0, "tensor"), (0.7, "tensor"), (0.7, "number")):
        temps = torch.full((rows,), t, device=logits.device)
        args = division_args(t if form == "number" else None, logits.dtype, logits.device)
        ref = torch.empty((1, rows, 8, 2), device=logits.device)
        launch_leaf_kernel(x, temps, ref, vocab, 0, args, num_warps=1)
        row: dict[str, Any] = {}
        for warps in (1, 2, 4):
            per_leaf = torch.empty_like(ref)

            def kernel(per_leaf=per_leaf, warps=warps, temps=temps, args=args):
                launch_leaf_kernel(x, temps, per_leaf, vocab, 0, args, num_warps=warps)

            kernel()
            row[f"w{warps}"] = {"us": _time_ms(kernel) * 1e3, "same_bits": _bits_equal(per_leaf, ref)}
        out[f"t{t}_{form}"] = row
        print(
            f"logprob kernel {tuple(logits.shape)} t={t} ({form}, chosen w{out['chosen']}): "
            + ", ".join(f"{w} {r['us']:.1f} us (same bits {r['same_bits']})" for w, r in row.items()),
            flush=True,
        )
    return out


def _reciprocal_division_rows(logits: torch.Tensor, tgt: torch.Tensor, score, bw: float) -> dict[str, Any]:
    """t = 0.7 as a Python number (the trainer's form: a device-checked reciprocal, ``temperature_triton``)
    against the same temperature as a tensor (div_rn per logit): the whole calls event-timed (the number form
    checks its temperature on the host per call), the scoring kernel alone graph-timed in both forms, and their
    bits."""
    from megatron_iso.ops.logprob import LocalShards
    from megatron_iso.ops.logprob.logprob_triton import TritonScores, launch_leaf_kernel
    from megatron_iso.ops.logprob.temperature_triton import division_args

    out: dict[str, Any] = {}
    rows, vocab = logits.shape
    temps = torch.full((rows,), 0.7, device=logits.device)
    per_leaf = torch.empty((1, rows, 8, 2), device=logits.device)
    for dt in (torch.bfloat16, torch.float16):
        lg = logits.to(dt)

        def by_number(lg=lg):
            return TritonScores(lg.unsqueeze(0), LocalShards(1), temperature=0.7, leaves=8).token_logprobs(
                tgt, ids_in_range=True
            )

        def kernel(args, asm=True, lg=lg, out=per_leaf):  # the leaf kernel alone, as TritonScores launches it
            launch_leaf_kernel(lg.unsqueeze(0), temps, out, vocab, 0, args, asm=asm)

        checked = division_args(0.7, dt, lg.device)
        row = {"reciprocal_checked": checked[2]}
        row["same_bits"] = _bits_equal(by_number(), score(lg, tgt, 0.7))
        for form, fn in (("number", by_number), ("tensor", lambda lg=lg: score(lg, tgt, 0.7))):
            ms = _time_events_ms(fn)
            gbs = lg.numel() * lg.element_size() / ms / 1e6
            row[form] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw}
        # asm False: tl.exp's subnormal fix-up in every slice (slice_exp_triton), the same bits
        for form, args, asm in (
            ("kernel_reciprocal", checked, True),
            ("kernel_reciprocal_exp_fixup", checked, False),
            ("kernel_div_rn", (1.0, 0.0, False), True),
        ):
            kernel(args, asm)
            ms = _time_ms(lambda args=args, asm=asm: kernel(args, asm))
            gbs = lg.numel() * lg.element_size() / ms / 1e6
            row[form] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw}
        fixup_everywhere = torch.empty_like(per_leaf)
        kernel(checked)
        kernel(checked, False, out=fixup_everywhere)
        row["slice_exp_same_bits"] = _bits_equal(per_leaf, fixup_everywhere)
        out[str(dt)] = row
        print(
            f"logprob {dt} {tuple(lg.shape)} t=0.7 events: number (reciprocal, checked={row['reciprocal_checked']}) "
            f"{row['number']['ms'] * 1e3:.1f} us ({row['number']['of_copy_bw']:.2f} of copy), tensor (div_rn) "
            f"{row['tensor']['ms'] * 1e3:.1f} us; same bits {row['same_bits']}; kernel alone (graph): reciprocal "
            f"{row['kernel_reciprocal']['ms'] * 1e3:.1f} us ({row['kernel_reciprocal']['of_copy_bw']:.2f} of copy), "
            f"div_rn {row['kernel_div_rn']['ms'] * 1e3:.1f} us, exp fix-up in every slice "
            f"{row['kernel_reciprocal_exp_fixup']['ms'] * 1e3:.1f} us (same bits {row['slice_exp_same_bits']})",
            flush=True,
        )
    return out


def entropy_bench(bw: float) -> dict[str, Any]:
    """The entropy statistic (one pass per vocab leaf) against copy bandwidth and the leaf-tree form it replaced."""
    from megatron_iso.ops.logprob import LocalShards, VocabScores
    from megatron_iso.ops.logprob.entropy import row_entropy

    res: dict[str, Any] = {}
    for T, V in ((4096, 151936), (64, 151936)):
        logits = _rand((T, V), torch.bfloat16, 32) * 4
        for dt in (torch.bfloat16, torch.float32):
            lg = logits.to(dt)
            ms = _time_events_ms(lambda lg=lg: row_entropy(lg, temperature=0.7, leaves=8))
            tree_ms = _time_events_ms(
                lambda lg=lg: VocabScores(lg.unsqueeze(0), LocalShards(1), temperature=0.7).entropy()
            )
            gbs = lg.numel() * lg.element_size() / ms / 1e6
            res[f"{dt}_{T}x{V}"] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw, "leaf_tree_ms": tree_ms}
            print(
                f"entropy {dt} {T}x{V}: {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs / bw:.2f} of copy); "
                f"leaf-tree form {tree_ms * 1e3:.1f} us",
                flush=True,
            )
    return res


def _record(res: dict[str, Any], key: str, call) -> None:
    """``res[key] = call()``; a failure is recorded there and printed, and the other benches still run."""
    try:
        res[key] = call()
    except Exception as exc:
        res[key] = {"error": repr(exc)[:500]}
        print(key, "ERROR", repr(exc)[:500], flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_ops.json")
    ap.add_argument("--sweep", action="store_true", help="time tile/park variants instead of the full table")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--sweep-large-only", action="store_true", help="with --sweep: skip the small-M schedules")
    ap.add_argument("--tiles", action="store_true", help="tile-equivalence experiment and G=1 tile candidates")
    ap.add_argument("--decode-tiles", action="store_true", help="tile candidates on the models' decode GEMMs")
    ap.add_argument("--attention", action="store_true", help="attention checks and timing vs SDPA, decode split")
    ap.add_argument("--attention-split", action="store_true", help="only the batch-1 decode split vs unsplit rows")
    ap.add_argument("--attention-backward", action="store_true", help="training attention backward vs SDPA")
    ap.add_argument("--attention-backward-sweep", action="store_true", help="the backward kernels' tile candidates")
    ap.add_argument("--skip-mem", action="store_true", help="skip RMSNorm / logprob / entropy")
    ap.add_argument("--moe", action="store_true", help="grouped expert GEMM vs per-expert cuBLAS / leaf-tree loops")
    ap.add_argument("--moe-tokens", default=",".join(map(str, MOE_TOKENS)), help="comma-separated token counts")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    from megatron_iso.bench.provenance import code_identity
    from megatron_iso.ops.gemm import gemm_triton as gt

    t0 = time.time()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(sys.argv),
        **code_identity(),
        "gemm_config_bf16": dataclasses.asdict(gt.CONFIGS[torch.bfloat16]),
        "gemm_selectable_tiles_bf16": [dataclasses.asdict(c) for c in gt.selectable_tiles(torch.bfloat16)],
    }
    res["copy_GBps"] = bw = copy_bandwidth()
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    for key, call in (
        ("gemm_checks_bf16", gemm_checks),
        ("gemm_checks_fp32", lambda: gemm_checks((1, 8), torch.float32)),
    ):
        try:
            res[key] = call()
        except Exception as exc:  # keep timing the rest; the failure is recorded and printed
            res[key] = {"error": repr(exc)[:500]}
    print(json.dumps({"bf16": res["gemm_checks_bf16"], "fp32": res["gemm_checks_fp32"]}, indent=1), flush=True)
    if args.attention:
        _record(res, "attention_checks", attention_checks)
        _record(res, "attention", attention_bench)
    if args.attention_split and not args.attention:
        _record(res, "attention_decode_split", attention_decode_split_rows)
    if args.attention_backward:
        _record(res, "attention_backward", attention_backward_bench)
    if args.attention_backward_sweep:
        _record(res, "attention_backward_sweep", attention_backward_sweep)
    if args.moe:
        _record(res, "moe", lambda: moe_bench(tuple(int(t) for t in args.moe_tokens.split(","))))
    if args.tiles:
        res["tile_equivalence"] = gemm_tile_equivalence()
        res["gemm_candidates"] = gemm_candidates()
    if args.decode_tiles:
        res["decode_tile_sweep"] = decode_tile_sweep()
    if args.sweep:
        res["sweep"] = gemm_sweep(not args.sweep_large_only)
    if not args.skip_gemm:
        res["gemm"] = gemm_table()
    mem_benches = (("rmsnorm", norm_bench), ("logprob", logprob_bench), ("entropy", entropy_bench))
    for key, call in () if args.skip_mem else mem_benches:
        _record(res, key, functools.partial(call, bw))
    res["seconds"] = time.time() - t0
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {args.out} in {res['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
