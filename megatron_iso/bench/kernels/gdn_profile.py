"""Gated DeltaNet bench, where the time goes: one case under torch.profiler (``tools/bench_gdn.py --profile``) and
the registers, spills and shared memory of every GDN kernel compiled for sm_90a without a GPU (``--resources``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_iso.bench.kernels import gdn_setup as setup
from megatron_iso.bench.kernels.gdn_cases import decode_fla, decode_ours, prefill_ours, profiled_calls, train_ours
from megatron_iso.bench.kernels.gdn_setup import fla_entry_points, parse_variant, split_variant


def profile_case(spec: str, iters: int) -> dict:
    """Our forward of one case (``train:BxT``, ``prefill:T``, ``decode:B``; ``decodeclose:B``: a decode step in which
    every sequence closes its chunk, the step ``decode:B`` never times; ``trainbwd:BxT``: the training forward and
    backward, gradient of the output fixed; ``flatrain:BxT``, ``fladecode:B``: FLA's) under torch.profiler, after two
    warm calls (Triton compiles, plan cache filled): per-kernel device time, calls, launch shapes, and host
    vs device time of the ``iters`` profiled calls.

    ``host_ms_per_call``: wall time until the call returns (launches only, no sync); ``wall_ms_per_call``: with a device
    sync after the calls; ``device_busy_ms_per_call``: sum of self device time of all ops; ``kernel_span_ms_per_call``:
    the device time the kernels cover (overlapping kernels counted once). Device busy far below wall means the host (or
    gaps between kernels) is the bottleneck; device busy close to wall means the kernels themselves are slow, and the
    kernel table says which."""
    from megatron_iso.bench.profiling import (
        kernel_events,
        kernel_launches,
        kernel_span_ms,
        print_kernel_launches,
        print_summary,
        summarize,
    )

    spec = split_variant(spec)
    kind, _, size = spec.partition(":")
    if kind in ("train", "trainbwd"):
        b, t = (int(x) for x in size.split("x"))
        fn, _ = train_ours(b, t)
        if kind == "trainbwd":
            fwd, d_out = fn, torch.randn(b * t, setup.HV, setup.D, device=setup.DEVICE)

            def fn() -> None:
                fwd().backward(d_out)
    elif kind == "flatrain":  # FLA's chunk forward on the same inputs: its per-kernel split, our budget
        b, t = (int(x) for x in size.split("x"))
        fla_chunk, _, fla_err = fla_entry_points()
        if fla_chunk is None:
            raise SystemExit(f"--profile {spec!r}: fla-core unavailable: {fla_err}")
        _, (q, k, v, g, beta) = train_ours(b, t)
        fq, fk, fv = (x.bfloat16() for x in (q, k, v))

        def fn() -> None:
            fla_chunk(*[x.detach().requires_grad_(True) for x in (fq, fk, fv, g, beta)], scale=setup.D**-0.5)
    elif kind == "prefill":
        fn, _ = prefill_ours(int(size))
    elif kind in ("decode", "decodeclose"):
        fn, _ = decode_ours(int(size), closing=kind == "decodeclose")
    elif kind == "fladecode":  # FLA's decode step on the same inputs: its device time beside ours
        _, fla_rec, fla_err = fla_entry_points()
        if fla_rec is None:
            raise SystemExit(f"--profile {spec!r}: fla-core unavailable: {fla_err}")
        fn = decode_fla(fla_rec, decode_ours(int(size))[1])
    else:
        raise SystemExit(
            f"--profile {spec!r}: expected train:BxT, trainbwd:BxT, flatrain:BxT, prefill:T, decode:B, decodeclose:B "
            "or fladecode:B"
        )
    cuda = setup.DEVICE == "cuda"
    # the training forwards run with inputs that require grad, as in the bench
    with torch.set_grad_enabled(kind.startswith(("train", "flatrain"))):
        prof, host, wall = profiled_calls(fn, iters)
    summary = summarize(prof, 15, device=cuda)
    events = kernel_events(prof) if cuda else []
    kernels = kernel_launches(events)
    span = kernel_span_ms(events) / iters if cuda else None
    busy = summary["device_busy_s"]
    row = {
        "case": "profile", "spec": spec, "iters": iters, "shape": {"Hk": setup.HK, "Hv": setup.HV, "D": setup.D, "chunk": setup.CHUNK},
        "host_ms_per_call": 1e3 * host / iters, "wall_ms_per_call": 1e3 * wall / iters,
        "device_busy_ms_per_call": None if busy is None else 1e3 * busy / iters, "kernel_span_ms_per_call": span,
        "kernels": kernels, "summary": summary,
    }  # fmt: skip
    print(f"profile {spec} ({iters} calls): host {row['host_ms_per_call']:.3f} ms/call, wall (synced) "
          f"{row['wall_ms_per_call']:.3f} ms/call, device busy {row['device_busy_ms_per_call']} ms/call, kernel span "
          f"{span} ms/call")  # fmt: skip
    if kernels:
        print_kernel_launches(kernels)
    print_summary(summary)
    return row


def kernel_resources(dot_precision: str | None = None, sass_dir: Path | None = None) -> dict:
    """Registers, spills and shared memory of every GDN kernel a decode step, a prefill that leaves a chunk open and a
    training forward + backward launch at the bench's Dk, Dv and chunk, compiled for sm_90a on this machine (no GPU
    needed: Triton's bundled ptxas). The calls run on CPU tensors with each launch replaced by a compile
    (``JITFunction.run`` intercepted): the signature comes from the launch's own arguments and constexprs, so it
    follows the kernels as they change. The numbers ptxas reports are static (per kernel), not dynamic counts.
    ``sass_dir``: also each kernel's SASS (Triton's bundled nvdisasm) as ``<kernel>[.<variant>].sass``."""
    import re
    import subprocess as sp
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from megatron_iso.ops.gdn import GDNLayerState
    from megatron_iso.ops.gdn.triton import tuning as G
    from megatron_iso.ops.gdn.triton.rule import gated_delta_rule

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("--resources compiles for the GPU: run it without TRITON_INTERPRET=1")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out: dict = {"target": "sm_90a", "triton": triton.__version__, "kernels": {}}

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)

    def compile_launch(fn: JITFunction, *args, grid, warmup, **kwargs) -> None:
        # Triton's own launch binding: the kernel signature, constexprs and the specialisations a launch on a GPU
        # gets (16-byte-aligned pointers and integers divisible by 16 marked so, which is what lets the compiler
        # vectorise loads; an integer 1 a constexpr). Without them every load compiles scalar here.
        bind = create_function_from_signature(fn.signature, fn.params, backend)
        options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, *bind(*args, **kwargs))
        consts = {fn.arg_names[path[0]]: v for path, v in constexprs.items()}
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        name = fn.fn.__name__
        key = (name, repr(sorted(consts.items())), repr(sorted(opts.items())), repr(sorted(attrs.items())))
        if key in seen:  # the same compiled kernel launched again
            return
        seen.add(key)
        name = f"{name} ({call[0]})" if name in out["kernels"] else name  # another variant, e.g. the training prep
        k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target, options=options.__dict__)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"{name}.ptx"
            src.write_text(k.asm["ptx"])
            log = sp.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                         capture_output=True, text=True, check=True).stderr  # fmt: skip
            if sass_dir is not None:
                sass = sp.run([str(ptxas.with_name("nvdisasm")), "-c", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
                sass_dir.mkdir(parents=True, exist_ok=True)
                variant = f".{dot_precision.replace(':', '_').replace('/', '_')}" if dot_precision else ""
                (sass_dir / f"{name}{variant}.sass").write_text(sass)

        def num(pattern: str) -> int | None:
            m = re.search(pattern, log)
            return int(m.group(1)) if m else None

        ptx = k.asm["ptx"]
        out["kernels"][name] = r = {
            "constexprs": {c: v if isinstance(v, (int, str, bool)) else str(v) for c, v in consts.items()}, **opts,
            "registers": num(r"Used (\d+) registers"), "stack_bytes": num(r"(\d+) bytes stack frame"),
            "spill_store_bytes": num(r"(\d+) bytes spill stores"), "spill_load_bytes": num(r"(\d+) bytes spill loads"),
            "shared_bytes": k.metadata.shared, "ptx_fma_f32": ptx.count("fma.rn.f32"),
            "ptx_bar_sync": ptx.count("bar.sync"), "ptx_vector_loads": len(re.findall(r"ld\.global[.\w]*\.v[248]\.", ptx)),
            # fp32 mul/add/sub that ptxas and LLVM may still contract into an fma (no .rn): none when the launch
            # passes enable_fp_fusion=False
            "enable_fp_fusion": options.enable_fp_fusion,
            "ptx_contractible_f32": len(re.findall(r"\b(?:mul|add|sub)\.f32\b", ptx)),
        }  # fmt: skip
        print(f"{name} {opts}: {r['registers']} regs, stack {r['stack_bytes']} B, spill st/ld "
              f"{r['spill_store_bytes']}/{r['spill_load_bytes']} B, shared {r['shared_bytes']} B, {r['ptx_fma_f32']} "
              f"fma.f32, {r['ptx_bar_sync']} bar.sync, {r['ptx_vector_loads']} vector loads (PTX)", flush=True)  # fmt: skip

    form, prec = parse_variant(dot_precision or G.DOT_PRECISION)
    kw = {"dot_precision": prec, "form": form or G.FORM, "chunk": setup.CHUNK}
    hk, hv, n = (
        setup.HK,
        setup.HV,
        2 * setup.CHUNK + 3,
    )  # the bench's head counts: strides and sizes specialise as on the GPU

    def inputs(t: int, grad: bool = False) -> list[torch.Tensor]:
        x = [
            torch.randn(t, hk, setup.D),
            torch.randn(t, hk, setup.D),
            torch.randn(t, hv, setup.D),
            -torch.rand(t, hv),
            torch.rand(t, hv),
        ]
        return [a.requires_grad_(grad) for a in x]

    state = GDNLayerState.allocate(2, conv_dim=1, conv_kernel=2, key_heads=hk, value_heads=hv, key_dim=setup.D, value_dim=setup.D,
                                   chunk=setup.CHUNK, form=kw["form"], v_dtype=torch.bfloat16,
                                   u_dtype=G.state_u_dtype(kw["form"], prec),
                                   )  # fmt: skip
    one = torch.tensor([1])
    seen: set = set()
    call = ["prefill"]
    orig = JITFunction.run
    JITFunction.run = compile_launch
    try:
        x = inputs(n)
        x[2] = x[2].bfloat16()  # v as the model passes it
        gated_delta_rule(*x, torch.tensor([0, n]), state=state, slots=one, starts=torch.tensor([0]), **kw)
        call[0] = "decode"
        gated_delta_rule(*(a[:1] for a in x), torch.tensor([0, 1]), state=state, slots=one, starts=torch.tensor([n]),
                         **kw)  # fmt: skip
        call[0] = "train"
        gated_delta_rule(*inputs(n, True), torch.tensor([0, n]), **kw).sum().backward()
    finally:
        JITFunction.run = orig
    return out
