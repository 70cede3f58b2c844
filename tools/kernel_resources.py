"""Registers, spills and shared memory of Triton kernels compiled for a GPU target, on a machine without one.

Triton compiles for a named target without a device (front end, LLVM, its bundled ``ptxas``); ``cuobjdump`` (also
bundled) reads the cubin's resource usage and SASS. What it answers: does a kernel spill (``STACK`` bytes, and how
many local-memory loads/stores sit inside its loops, where they cost every iteration), how much shared memory a
program takes, and so how many programs an sm_90 SM holds at once. What it cannot: time (ask the GPU).

    python tools/kernel_resources.py                       # the attention forward's prefill tiles, register vs park
    python tools/kernel_resources.py --tile bf16:128:64,4,3 --tile bf16:128:64,4,2,park --gate dim
    python tools/kernel_resources.py --sass-dir /tmp/sass_a   # then the same in another tree, and diff -r the two
    python tools/kernel_resources.py --gemm                   # the 8-leaf GEMM's loops: flat vs TMA vs Gluon tiles
    python tools/kernel_resources.py --gemm-tile 128x64,8,4,tma,p1 --gemm-shape 16384,4096,12288,8

``--sass-dir``: each tile's SASS (``cuobjdump -sass``) as a file, the proof a kernel refactor meant to change no
instruction carries: equal files before and after, encodings included.

``--tile DTYPE:HEAD_DIM:ROWS,WARPS,STAGES[,park][,rMAXNREG]``: the one-launch attention forward
(``forward_launch_triton.prepare``, a training pack) under that tile config. :func:`compiled_launches` does the
same for any code that launches Triton kernels: inside it a launch compiles (with the signature, constexprs and
divisibility specialisations the launch binds, as on a GPU) instead of running.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

# sm_90 (H100 / H200) per-SM limits, for the programs-per-SM estimate.
SM90_SHARED_PER_SM = 228 * 1024
SM90_SHARED_PER_BLOCK = 227 * 1024
SM90_SHARED_RESERVED_PER_BLOCK = 1024
SM90_REGISTERS_PER_SM = 65536
SM90_MAX_THREADS_PER_SM = 2048


@dataclass(frozen=True)
class KernelResources:
    registers: int  # per thread
    stack_bytes: int  # per-thread local memory for spills (0: no spill)
    shared_bytes: int  # per program
    spill_ops_in_loops: int  # local loads/stores (LDL/STL) inside the kernel's loops, in the SASS
    spill_ops: int  # all of them
    num_warps: int
    sass: str = field(default="", repr=False, compare=False)  # cuobjdump -sass of the cubin

    def programs_per_sm(self) -> int:
        """Programs of this kernel one sm_90 SM holds at once (shared memory, registers and threads)."""
        if self.shared_bytes > SM90_SHARED_PER_BLOCK:
            return 0
        threads = 32 * self.num_warps
        by_regs = SM90_REGISTERS_PER_SM // (threads * (-(-self.registers // 8) * 8))
        by_smem = SM90_SHARED_PER_SM // (self.shared_bytes + SM90_SHARED_RESERVED_PER_BLOCK)
        return min(by_regs, SM90_MAX_THREADS_PER_SM // threads, by_smem)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _spill_ops(sass: str) -> tuple[int, int]:
    """(local loads/stores inside loops, all of them) in a cubin's SASS; a loop is a backward branch's range."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spills = [a for a, i in ins if re.search(r"\b(LDL|STL)\b", i)]
    loops = []
    for a, i in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", i)
        if m and int(m.group(1), 16) < a:
            loops.append((int(m.group(1), 16), a))
    return sum(1 for a in spills if any(lo <= a <= hi for lo, hi in loops)), len(spills)


def _resources(cubin_bytes: bytes, shared: int, num_warps: int) -> KernelResources:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(cubin_bytes)
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
        m = re.search(r"REG:(\d+) STACK:(\d+)", res.stdout)
        if m is None:
            raise RuntimeError(f"kernel_resources: no resource line in cuobjdump's output:\n{res.stdout}")
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True)
        in_loops, total = _spill_ops(sass.stdout)
    return KernelResources(int(m.group(1)), int(m.group(2)), shared, in_loops, total, num_warps, sass.stdout)


@contextlib.contextmanager
def compiled_launches(arch: int = 90) -> Iterator[dict[str, KernelResources]]:
    """Inside the block every ``@triton.jit`` launch compiles for ``sm_{arch}`` instead of running; the yielded
    dict maps each launched kernel's name to its :class:`KernelResources` (the first launch of each name). Launch
    with CPU tensors: the binding is Triton's own (signature, constexprs, 16-byte alignment and divisible-by-16
    integers marked as a GPU launch would mark them), so the compiled code is the launch's."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compiled_launches compiles for the GPU: run it without TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    found: dict[str, KernelResources] = {}

    def compile_launch(fn: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        name = fn.fn.__name__
        if name in found:
            return
        bind = create_function_from_signature(fn.signature, fn.params, backend)
        options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, *bind(*args, **kwargs))
        source = ASTSource
        if fn.is_gluon():
            from triton.experimental.gluon._runtime import GluonASTSource as source
        k = triton.compile(source(fn, sig, constexprs, attrs), target=target, options=options.__dict__)
        found[name] = _resources(k.asm["cubin"], k.metadata.shared, options.num_warps)

    orig = JITFunction.run
    JITFunction.run = compile_launch
    try:
        yield found
    finally:
        JITFunction.run = orig


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attention_resources(dtype: str, head_dim: int, cfg: Any, *, gate: str = "none", group: int = 4) -> KernelResources:
    """The one-launch attention forward (``_attend_kernel``) of a training pack under tile config ``cfg``, launched
    by ``forward_launch_triton.prepare`` as the model does (8 kv heads, ``group`` query heads each).

    ``dtype``: bf16 / fp16 / fp32; ``gate``: none / dim (per element) / head (one per head)."""
    from megatron_iso.ops.attention import forward_launch_triton as launch

    if dtype not in _DTYPES:
        raise ValueError(f"attention_resources: dtype={dtype!r} must be one of {sorted(_DTYPES)}")
    gate_width = {"none": None, "dim": head_dim, "head": 1}
    if gate not in gate_width:
        raise ValueError(f"attention_resources: gate={gate!r} must be one of {sorted(gate_width)}")
    hkv, lens = 8, [256, 256]
    dt, t = _DTYPES[dtype], sum(lens)
    q = torch.zeros(t, hkv * group, head_dim, dtype=dt)
    k, v = (torch.zeros(t, hkv, head_dim, dtype=dt) for _ in range(2))
    g = None if gate == "none" else torch.zeros(t, hkv * group, gate_width[gate], dtype=dt)
    cu = [0, lens[0], t]
    call, _ = launch.prepare(q, k, v, g, cu, [0, 0], cu[:-1], head_dim**-0.5, 64, cfg, split=False)
    with compiled_launches() as found:
        call()
    return found["_attend_kernel"]


def _parse_tile(spec: str) -> tuple[str, int, Any]:
    from megatron_iso.ops.attention.forward_launch_triton import AttentionTileConfig

    try:
        dtype, dim, tile = spec.split(":")
        parts = tile.split(",")
        extra = parts[3:]
        caps = [int(p[1:]) for p in extra if p.startswith("r")]
        if len(parts) < 3 or len(caps) > 1 or any(p != "park" and not p.startswith("r") for p in extra):
            raise ValueError
        cfg = AttentionTileConfig(*map(int, parts[:3]), park="park" in extra, maxnreg=caps[0] if caps else None)
        return dtype, int(dim), cfg
    except ValueError:
        raise SystemExit(f"--tile {spec!r}: expected DTYPE:HEAD_DIM:ROWS,WARPS,STAGES[,park][,rMAXNREG]") from None


DEFAULT_TILES = (
    "bf16:128:64,4,3",
    "bf16:128:64,4,3,park",
    "bf16:128:64,4,2",
    "bf16:128:64,4,2,park",
    "bf16:128:64,8,3",
    "bf16:256:64,8,2",
    "bf16:256:64,8,2,park",
    "bf16:256:64,8,1,park",
)


def gemm_resources(m: int, n: int, k: int, leaves: int, cfg: Any) -> KernelResources:
    """The leaf-tree GEMM kernel ``leaf_tree_linear_triton`` launches for bf16 ``[m, k] @ [n, k].T`` in ``leaves``
    leaves under tile config ``cfg`` (one program per output tile)."""
    from megatron_iso.ops.gemm import gemm_triton as gt

    x, w = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16)
    with compiled_launches() as found:
        gt.leaf_tree_linear_triton(x, w, leaves, parallel=1, config=cfg)
    (res,) = found.values()
    return res


def wgmma_waits(sass: str) -> str:
    """The distinct ``WARPGROUP.DEPBAR.LE gsb0, N`` waits: only 0 means every wgmma is waited for before the next
    (no tensor-core work overlaps the loop's other instructions); 1 keeps one in flight."""
    return ",".join(sorted(set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", sass)))) or "-"


def _parse_gemm_tile(spec: str) -> Any:
    from megatron_iso.ops.gemm.tiles import LOOPS, TRITON_BLOCK_K, GemmTileConfig

    try:
        tile, warps, stages, loop, *park = spec.split(",")
        bm, bn = map(int, tile.split("x"))
        if loop not in LOOPS or len(park) > 1 or (park and not park[0].startswith("p")):
            raise ValueError
        park_from = int(park[0][1:]) if park else 0
        return GemmTileConfig(bm, bn, TRITON_BLOCK_K["bf16"], int(warps), int(stages), park_from=park_from, loop=loop)
    except ValueError:
        raise SystemExit(
            f"--gemm-tile {spec!r}: expected BMxBN,WARPS,STAGES,LOOP[,pPARK_FROM] (LOOP: {LOOPS})"
        ) from None


DEFAULT_GEMM_TILES = (
    "128x128,8,4,flat,p0",
    "128x128,8,4,tma,p0",
    "128x128,8,3,tma,p1",
    "128x64,8,4,tma,p1",
    "128x128,8,4,gluon,p1",
    "128x256,8,3,gluon,p0",
    "128x128,4,3,gluon,p0",
    "64x128,4,4,gluon,p1",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tile", action="append", help="DTYPE:HEAD_DIM:ROWS,WARPS,STAGES[,park][,rMAXNREG] (repeatable)")
    ap.add_argument("--gate", default="none", choices=("none", "dim", "head"))
    ap.add_argument("--group", type=int, default=4, help="query heads per kv head (default 4, as Qwen3-8B)")
    ap.add_argument("--sass-dir", type=Path, help="write each tile's SASS to DIR/<tile>.sass (diff two trees' dirs)")
    ap.add_argument(
        "--gemm-tile", action="append", help="the bf16 leaf-tree GEMM instead: BMxBN,WARPS,STAGES,LOOP[,pN]"
    )
    ap.add_argument("--gemm", action="store_true", help="the leaf-tree GEMM's default candidate tiles")
    ap.add_argument("--gemm-shape", default="4096,4096,4096,8", help="M,N,K,LEAVES of the GEMM (default 4096^3, 8)")
    args = ap.parse_args(argv)
    if args.sass_dir:
        args.sass_dir.mkdir(parents=True, exist_ok=True)
    if args.gemm or args.gemm_tile:
        m, n, k, leaves = map(int, args.gemm_shape.split(","))
        print(f"leaf-tree GEMM, bf16, {m} x {n} x {k}, {leaves} leaves, sm_90")
        specs = args.gemm_tile or DEFAULT_GEMM_TILES
        kernels = {s: lambda s=s: gemm_resources(m, n, k, leaves, _parse_gemm_tile(s)) for s in specs}
    else:
        print(f"attention one-launch forward, sm_90, gate={args.gate}, group={args.group}")
        kernels = {
            s: lambda s=s: attention_resources(*_parse_tile(s), gate=args.gate, group=args.group)
            for s in args.tile or DEFAULT_TILES
        }
    print(
        f"{'tile':<24}{'regs':>6}{'stack B':>9}{'spill ops in loops':>20}{'all':>6}{'shared B':>10}{'per SM':>8}"
        "  wgmma waits"
    )
    for spec, compile_kernel in kernels.items():
        r = compile_kernel()
        if args.sass_dir:
            (args.sass_dir / (re.sub(r"[^A-Za-z0-9]+", "_", spec) + ".sass")).write_text(r.sass)
        print(
            f"{spec:<24}{r.registers:>6}{r.stack_bytes:>9}{r.spill_ops_in_loops:>20}{r.spill_ops:>6}"
            f"{r.shared_bytes:>10}{r.programs_per_sm():>8}  {wgmma_waits(r.sass)}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
