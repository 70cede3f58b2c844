"""Check and time the Triton (GPU) correctness-profile ops against their stock baselines.

Every run checks before it times: batch invariance (row 0 bitwise across M), the TP-subtree
identity of the leaf tree, and that the M-dependent schedule never changes a bit. Then it times the
leaf-tree GEMM against cuBLAS (``x @ w.t()``) and the memory-bound ops against the copy bandwidth
measured in the same run. All timings are CUDA-graph replays (``triton.testing.do_bench_cudagraph``,
median), so launch overhead of the Python wrappers is not what is measured: decode runs under graphs.

    python tools/bench_ops.py --out bench.json            # full table (issue 4 grid)
    python tools/bench_ops.py --sweep --out sweep.json    # tile/park variants of the G=8 GEMM
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import torch

MS = (1, 16, 64, 256, 1024, 4096, 16384)
NKS = ((4096, 4096), (8192, 8192), (4096, 14336))


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
    # Events around 20 plain copies (no graph): the graph-replayed copy read low (2.8 TB/s) on the H200.
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


def _gemm_time(M, N, K, G, dtype=torch.bfloat16, parallel=None, config=None):
    from megatron_iso.ops.gemm import gemm_triton as gt

    x = _rand((M, K), dtype, 10)
    w = _rand((N, K), dtype, 11)
    fn = lambda: gt.leaf_tree_linear_triton(x, w, G, parallel=parallel, config=config)  # noqa: E731
    fn()
    ck = gt.LAST_COMPILED
    regs = getattr(ck, "n_regs", None)
    spills = getattr(ck, "n_spills", None)
    ms = _time_ms(fn)
    return ms, regs, spills


def _cublas_ms(M, N, K, dtype=torch.bfloat16):
    x = _rand((M, K), dtype, 10)
    w = _rand((N, K), dtype, 11)
    return _time_ms(lambda: x @ w.t())


def gemm_sweep(small_m: bool = True) -> list[dict[str, Any]]:
    """Tile / park / loop variants of the 8-leaf tree at large M, and schedules at small M."""
    from megatron_iso.ops.gemm.gemm_triton import GemmTileConfig as C

    variants = {
        "f_128x128_w8_s4_p0": C(128, 128, 64, 8, 4, park_from=0, loop="flat"),
        "f_128x128_w8_s3_p0": C(128, 128, 64, 8, 3, park_from=0, loop="flat"),
        "f_128x128_w8_s4_p1": C(128, 128, 64, 8, 4, park_from=1, loop="flat"),
        "f_128x256_w8_s2_p0": C(128, 256, 64, 8, 2, park_from=0, loop="flat"),
        "f_128x128_w4_s4_p0": C(128, 128, 64, 4, 4, park_from=0, loop="flat"),
    }
    rows = []
    shapes = [(4096, 4096, 4096), (4096, 8192, 8192), (4096, 4096, 14336)]
    for M, N, K in shapes:
        cub = _cublas_ms(M, N, K)
        tf = lambda ms, M=M, N=N, K=K: 2 * M * N * K / ms / 1e9  # noqa: E731
        print(f"cuBLAS {M}x{N}x{K}: {tf(cub):.0f} TFLOP/s", flush=True)
        for name, cfg in variants.items():
            for G in (8,):
                try:
                    ms, regs, spills = _gemm_time(M, N, K, G, config=cfg, parallel=1)
                except Exception as exc:  # a variant that does not compile is a result too
                    rows.append({"variant": name, "M": M, "N": N, "K": K, "G": G, "error": repr(exc)[:300]})
                    print(f"  {name} G={G}: ERROR {exc!r}"[:200], flush=True)
                    continue
                r = {"variant": name, "M": M, "N": N, "K": K, "G": G, "ms": ms, "tflops": tf(ms),
                     "ratio": cub / ms, "regs": regs, "spills": spills, "cublas_tflops": tf(cub)}  # fmt: skip
                rows.append(r)
                print(f"  {name} G={G}: {tf(ms):.0f} TFLOP/s  {cub / ms:.2f}x  regs={regs} spills={spills}", flush=True)
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
    try:
        from megatron_iso.ops.logprob.logprob_triton import token_logprobs_triton
    except ImportError as exc:
        return {"skipped": repr(exc)}
    res: dict[str, Any] = {}
    for T, V in ((4096, 151936), (1, 151936), (16384, 32768)):
        logits = _rand((T, V), torch.bfloat16, 30) * 4
        tgt = torch.randint(0, V, (T,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(31))
        for dt in (torch.bfloat16, torch.float32):
            lg = logits.to(dt)
            # Not graph-capturable (the wrapper validates ids/temperature on the host): event timing.
            ms = _time_events_ms(lambda lg=lg, tgt=tgt: token_logprobs_triton([lg], tgt, temperature=0.7, leaves=8))
            gbs = lg.numel() * lg.element_size() / ms / 1e6
            res[f"{dt}_{T}x{V}"] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw}
            print(f"logprob {dt} {T}x{V}: {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs / bw:.2f} of copy)", flush=True)
        full = token_logprobs_triton([logits], tgt, temperature=0.7, leaves=8)
        res[f"row0_bitwise_{T}x{V}"] = all(
            _bits_equal(token_logprobs_triton([logits[:m]], tgt[:m], temperature=0.7, leaves=8)[0], full[0])
            for m in (1, 3)
        )
        if V % 2 == 0:
            # vocab split over 2 simulated ranks, 4 leaves each, must equal 8 leaves on one
            from megatron_iso.ops.logprob import logprob_triton as lt

            if hasattr(lt, "vocab_parallel_check"):
                res[f"tp2_bitwise_{T}x{V}"] = lt.vocab_parallel_check(logits, tgt, 0.7, 8, 2)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_ops.json")
    ap.add_argument("--sweep", action="store_true", help="time tile/park variants instead of the full table")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--sweep-large-only", action="store_true", help="with --sweep: skip the small-M schedules")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    from megatron_iso.ops.gemm import gemm_triton as gt

    t0 = time.time()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(sys.argv),
        "gemm_config_bf16": dataclasses.asdict(gt.CONFIGS[torch.bfloat16]),
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
    if args.sweep:
        res["sweep"] = gemm_sweep(not args.sweep_large_only)
    if not args.skip_gemm:
        res["gemm"] = gemm_table()
    for key, call in (("rmsnorm", norm_bench), ("logprob", logprob_bench)):
        try:
            res[key] = call(bw)
        except Exception as exc:
            res[key] = {"error": repr(exc)[:500]}
            print(key, "ERROR", repr(exc)[:500], flush=True)
    res["seconds"] = time.time() - t0
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {args.out} in {res['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
