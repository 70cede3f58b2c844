"""Time the SwiGLU / RoPE Triton kernels against the fp64 torch references they replace (GPU).

What matters for the iso decoder is host time: the references launch dozens of elementwise kernels per
call. For each op and shape this records the CPU time per call (wrapper + launches, no sync inside the
loop), the GPU time per call (CUDA events around a synchronised loop), and checks bitwise equality of
the two outputs first (NaN-aware; see tests/gpu/test_ieee_math_triton.py). It also counts how many
fp64 helper results change when the same kernel is compiled WITH FMA contraction, which is why the
kernels launch with ``enable_fp_fusion=False``.

    python tools/bench_ieee_math.py --out $OUT/ieee_math.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    t = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return int(((a.view(t) != b.view(t)) & ~(a.isnan() & b.isnan())).sum())


def _time(fn: Callable[[], Any], iters: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    cpu = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return {"cpu_ms_per_call": cpu * 1e3, "gpu_ms_per_call": start.elapsed_time(end) / iters}


def bench(iters: int) -> dict[str, Any]:
    from megatron_iso.ops.activation import reference as act_ref
    from megatron_iso.ops.activation.activation_triton import swiglu_triton
    from megatron_iso.ops.rope import reference as rope_ref
    from megatron_iso.ops.rope.rope_triton import apply_rope_triton, rope_cos_sin_triton

    rows: list[dict[str, Any]] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1, 64, 4096):
        for ffn in (3072, 12288):
            x = (torch.randn(tokens, 2 * ffn, device="cuda", generator=g) * 4).bfloat16()
            gate, up = torch.chunk(x, 2, dim=-1)
            row = {"op": "swiglu", "tokens": tokens, "ffn": ffn, "dtype": "bf16",
                   "mismatches": _mismatch(swiglu_triton(gate, up), act_ref.swiglu(gate, up))}  # fmt: skip
            row["reference"] = _time(lambda gate=gate, up=up: act_ref.swiglu(gate, up), iters)
            row["triton"] = _time(lambda gate=gate, up=up: swiglu_triton(gate, up), iters)
            rows.append(row)
        pos = torch.randint(0, 100000, (tokens,), device="cuda", generator=g)
        for heads, head_dim, rot in ((32, 128, 128), (16, 256, 64)):
            c, s = rope_cos_sin_triton(pos, rot, 1e6)
            rc, rs = rope_ref.rope_cos_sin(pos, rot, 1e6)
            q = (torch.randn(tokens, heads, head_dim, device="cuda", generator=g)).bfloat16()
            row = {"op": "apply_rope", "tokens": tokens, "heads": heads, "head_dim": head_dim, "rot": rot,
                   "mismatches": _mismatch(apply_rope_triton(q, c, s), rope_ref.apply_rope(q, rc, rs))
                   + _mismatch(c, rc) + _mismatch(s, rs)}  # fmt: skip
            row["reference"] = _time(lambda q=q, rc=rc, rs=rs: rope_ref.apply_rope(q, rc, rs), iters)
            row["triton"] = _time(lambda q=q, c=c, s=s: apply_rope_triton(q, c, s), iters)
            rows.append(row)
            crow = {"op": "rope_cos_sin", "tokens": tokens, "rot": rot}
            crow["reference"] = _time(lambda pos=pos, rot=rot: rope_ref.rope_cos_sin(pos, rot, 1e6), iters)
            crow["triton"] = _time(lambda pos=pos, rot=rot: rope_cos_sin_triton(pos, rot, 1e6), iters)
            rows.append(crow)
    return {"rows": rows}


def fma_effect() -> dict[str, int]:
    """How many fp64 helper results differ from the reference when compiled with FMA contraction on."""
    from megatron_iso.ops.common import ieee_math, ieee_math_triton

    x = torch.randn(1 << 20, device="cuda", dtype=torch.float64) * 30
    out = {}
    for name, ref in (("exp64", ieee_math.exp64), ("sigmoid64", ieee_math.sigmoid64)):
        fused = torch.empty_like(x)
        ieee_math_triton._eval64_kernel[(x.numel() // 1024,)](
            x, fused, x.numel(), FN=ieee_math_triton._EVAL64[name], BLOCK=1024, enable_fp_fusion=True
        )
        want = ref(x)
        out[f"{name}_fused_mismatches"] = _mismatch(fused, want)
        out[f"{name}_nofma_mismatches"] = _mismatch(ieee_math_triton.eval64(name, x), want)
    a = torch.rand(1 << 20, device="cuda", dtype=torch.float64) * 1e5
    out["sin64_nofma_mismatches"] = _mismatch(ieee_math_triton.eval64("sin64", a), ieee_math.sincos64(a)[0])
    out["n"] = x.numel()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="ieee_math.json")
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "fma": fma_effect()}
    res |= bench(a.iters)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["fma"]))
    for r in res["rows"]:
        ref, tri = r["reference"], r["triton"]
        print(f"{r['op']:13s} T={r['tokens']:5d} {r.get('ffn', r.get('rot', '')):>6} mism={r.get('mismatches', '-')} "
              f"cpu {ref['cpu_ms_per_call']:.3f}->{tri['cpu_ms_per_call']:.3f} ms  "
              f"gpu {ref['gpu_ms_per_call']:.3f}->{tri['gpu_ms_per_call']:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
