"""The leaf-tree GEMM against cuBLAS: batch-invariance checks, the M x N x K table, tile sweeps and candidates
(``tools/bench_ops.py``: the default table, ``--sweep``, ``--tiles``, ``--decode-tiles``)."""

from __future__ import annotations

import json
from typing import Any

import torch

from megatron_iso.bench.kernels.timing import rand, time_ms
from megatron_iso.testing.bits import same_bits

MS = (1, 16, 64, 256, 1024, 4096, 16384)
# (N, K) of Qwen3-8B's linears: attention output and MLP down (row-parallel, the 8-leaf tree), fused QKV and
# gate/up (column-parallel, one leaf).
NKS = ((4096, 4096), (4096, 12288), (6144, 4096), (24576, 4096))


def gemm_checks(leaves_list=(1, 2, 8), dtype=torch.bfloat16, config=None) -> dict[str, Any]:
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton as f

    out: dict[str, Any] = {}
    N, K = 1024, 4096
    w = rand((N, K), dtype, 1)
    x = rand((2048, K), dtype, 2)
    for G in leaves_list:
        full = f(x, w, G, config=config)
        ok_rows = all(same_bits(f(x[:m], w, G, config=config)[0], full[0]) for m in (1, 2, 3, 7, 8, 64, 1000))
        perm = torch.randperm(x.shape[0], device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
        ok_perm = same_bits(f(x[perm], w, G, config=config), full[perm])
        ok_sched = all(same_bits(f(x[:64], w, G, parallel=p, config=config), full[:64]) for p in (1, 2, 4, 8) if p <= G)
        ref = (x.double() @ w.double().t()).float()
        rel = float((full - ref).norm() / ref.norm())
        rec = {"row0_bitwise_M": ok_rows, "permutation_bitwise": ok_perm, "schedule_bitwise": ok_sched, "rel_err": rel}
        if G >= 2:
            h = K // 2
            halves = f(x[:, :h], w[:, :h], G // 2, config=config) + f(x[:, h:], w[:, h:], G // 2, config=config)
            rec["tp2_halves_bitwise"] = same_bits(halves, full)
        out[f"G{G}"] = rec
    return out


def _gemm_time(M, N, K, G, dtype=torch.bfloat16, parallel=None, config=None, same_as=None):
    """(ms, registers, spills) of one leaf-tree GEMM launch; with ``same_as`` (a config) also whether its output
    has that config's bits on the same inputs."""
    from megatron_iso.ops.gemm import gemm_triton as gt

    x = rand((M, K), dtype, 10)
    w = rand((N, K), dtype, 11)
    fn = lambda: gt.leaf_tree_linear_triton(x, w, G, parallel=parallel, config=config)  # noqa: E731
    out = fn()
    ck = gt.LAST_COMPILED
    regs = getattr(ck, "n_regs", None)
    spills = getattr(ck, "n_spills", None)
    ms = time_ms(fn)
    if same_as is None:
        return ms, regs, spills
    return ms, regs, spills, same_bits(out, gt.leaf_tree_linear_triton(x, w, G, parallel=1, config=same_as))


def _cublas_ms(M, N, K, dtype=torch.bfloat16):
    x = rand((M, K), dtype, 10)
    w = rand((N, K), dtype, 11)
    return time_ms(lambda: x @ w.t())


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
        x = rand((300, 2048), dtype, 51)
        w = rand((640, 2048), dtype, 52)
        for G in (1, 8):
            base = f(x, w, G, parallel=1, config=CONFIGS[dtype])
            for name, cfg in cfgs.items():
                key = f"{str(dtype).removeprefix('torch.')}_G{G}_{name}"
                if G > 1 and cfg.block_n >= 256 and cfg.num_stages > 2:
                    continue  # does not fit shared memory with the 8-leaf park buffer
                try:
                    out = f(x, w, G, parallel=1, config=cfg)
                    res[key] = same_bits(out, base)
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
        x, w = rand((M, K), torch.bfloat16, 1), rand((N, K), torch.bfloat16, 2)
        base = gt.leaf_tree_linear_triton(x, w, G, parallel=1, config=gt.CONFIGS[torch.bfloat16])
        cub = time_ms(lambda x=x, w=w: x @ w.t())
        picked = time_ms(lambda x=x, w=w, G=G: gt.leaf_tree_linear_triton(x, w, G))
        head = {"model": model, "linear": name, "M": M, "N": N, "K": K, "G": G, "cublas_us": cub * 1e3}
        rows.append({**head, "cfg": "selected", "us": picked * 1e3, "ratio": cub / picked})
        best = None
        for cname, cfg in cands.items():
            for par in (None,) if G == 1 else (None, 1, 8):
                try:
                    ok = same_bits(gt.leaf_tree_linear_triton(x, w, G, parallel=par, config=cfg), base)
                    ms = time_ms(
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
