"""The grouped expert GEMM at Qwen3-30B-A3B expert shapes (``tools/bench_ops.py --moe``), and the skewed routed
token counts that it and ``tools/bench_moe_backward.py`` time (``moe_counts`` runs on CPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_iso.bench.kernels.timing import rand, time_ms
from megatron_iso.testing.bits import same_bits

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
    ws = [rand((N, K), dt, 1000 + e) / K**0.5 for e in range(MOE_E)]
    stacked = torch.stack(ws)  # only for torch._grouped_mm
    for tokens in tokens_list:
        counts = moe_counts(tokens)
        T = sum(counts)
        x = rand((T, K), dt, 2000 + tokens)
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
        base["cublas_loop_ms"] = time_ms(cublas)
        try:
            offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
            gmm = lambda x=x, offs=offs: torch._grouped_mm(x, stacked.transpose(-2, -1), offs=offs)  # noqa: E731
            base["torch_grouped_mm_ms"] = time_ms(gmm)
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
                r["grouped_eq_leaf_tree_loop_bitwise"] = same_bits(out, loop)
                r["grouped_rel_err_vs_fp32"] = float((out - ref).norm() / ref.norm())
                r["cublas_rel_err_vs_fp32"] = float(
                    (torch.cat([t.float() for t in cublas()]) - ref).norm() / ref.norm()
                )
                r["grouped_tile"] = dataclasses.asdict(grouped_config(dt, T, MOE_E, G))
                r["grouped_ms"] = time_ms(lambda x=x, G=G, c=counts_dev: grouped(x, ws, c, G))
                r["leaf_tree_loop_ms"] = time_ms(lambda spans=spans, G=G: [dense(xe, ws[e], G) for e, xe in spans])
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
