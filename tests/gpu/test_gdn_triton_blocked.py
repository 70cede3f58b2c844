"""ONE-OFF check (GPU): the K-blocked state-pass kernels give the bits of the previous version.

megatron_iso/ops/gdn/gdn_triton.py splits every fp32 ieee ``tl.dot`` of ``_prep_kernel`` and
``_chain_kernel`` along K and carries the accumulator across the blocks in ascending k (to stop the
register spills). The claim is that this is bit-neutral on the GPU: Triton 3.6 lowers such a dot to one
fma chain per output element over k = 0..K-1 starting from the accumulator operand, so the blocked form
runs the same fmas in the same order (argument in ``gdn_triton._kblock_note``). This test confirms it by
running whole forwards (training, chunked prefill, decode closing chunks from the state-cache buffer,
padded Dk/Dv) twice, once with the current kernels and once with a FROZEN copy of the previous ones
(tests/gpu/gdn_triton_v1.py) patched into the module, and comparing outputs and every state-cache
tensor bit for bit. Delete this file and gdn_triton_v1.py once it has passed on the GPU.

Under TRITON_INTERPRET=1 the dot is numpy's matmul (blocked sums round differently), so there
``run_case(..., exact=False)`` only checks the harness and the math (tolerance 1e-5).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_iso.testing.gdn_inputs import random_gdn_inputs
from tests.gpu import gdn_triton_v1 as v1


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


class _V1Prep:
    """Launches the frozen prep kernel with the current launch call's arguments (drops the scratch and KB)."""

    def __getitem__(self, grid):
        def launch(*args, C, BK, BVF, KB, num_warps, num_stages):
            a = list(args)
            del a[13:15]  # tinv, bce scratch
            v1._prep_kernel[grid](*a, C=C, BK=BK, BVF=BVF, num_warps=num_warps)

        return launch


class _V1Chain:
    def __getitem__(self, grid):
        def launch(*args, C, BK, BVF, BV, KB, num_warps, num_stages):
            v1._chain_kernel[grid](*args, C=C, BK=BK, BVF=BVF, BV=BV, num_warps=num_warps)

        return launch


@contextlib.contextmanager
def _frozen_kernels(gt):
    prep, chain = gt._prep_kernel, gt._chain_kernel
    gt._prep_kernel, gt._chain_kernel = _V1Prep(), _V1Chain()
    try:
        yield
    finally:
        gt._prep_kernel, gt._chain_kernel = prep, chain


def _forward_all(gt, x, chunk, lengths, pieces):
    """Training forward over packed ``lengths``, then sequence 0 again as chunked prefill ``pieces``
    through a state cache (decode steps close chunks from the buffer). Returns every tensor produced."""
    from megatron_iso.ops.gdn import GDNLayerState

    dev = x[0].device
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    outs = {"train": gt.gated_delta_rule(*x, cu, chunk=chunk)}
    hk, dk = x[1].shape[1:]
    hv, dv = x[2].shape[1:]
    st = GDNLayerState.allocate(2, conv_dim=4, conv_kernel=4, key_heads=hk, value_heads=hv, key_dim=dk,
                                value_dim=dv, chunk=chunk, dtype=torch.float32, device=dev)  # fmt: skip
    pos = 0
    for i, n in enumerate(pieces):
        r = slice(pos, pos + n)
        outs[f"piece{i}"] = gt.gated_delta_rule(
            *(t[r] for t in x), torch.tensor([0, n], device=dev), chunk=chunk, state=st,
            slots=torch.tensor([1], device=dev), starts=torch.tensor([pos], device=dev),
        )  # fmt: skip
        pos += n
    for name in ("running", "entry", "buf_k", "buf_v", "buf_g", "buf_beta"):
        outs[name] = getattr(st, name)[1].clone()
    return outs


# (chunk, Dk, Dv, Hk, Hv, lengths, pieces of sequence 0)
CASES = [
    (64, 128, 128, 2, 4, [300, 64, 129], [70, 1, 1, 60, 1, 1, 1, 100]),  # Qwen3-Next head shape
    (16, 32, 32, 2, 4, [45, 16, 3], [20, 1, 1, 10, 13]),
    (16, 24, 40, 1, 3, [37, 33], [17, 15, 1, 4]),  # padded Dk (BK 32) and Dv (BVF 64, Dv blocks 32 + 8)
]


def run_case(gt, case, device: str, exact: bool) -> None:
    chunk, dk, dv, hk, hv, lengths, pieces = case
    x = random_gdn_inputs(sum(lengths), 31 + chunk + dk, hk=hk, hv=hv, dk=dk, dv=dv, device=device)
    new = _forward_all(gt, x, chunk, lengths, pieces)
    with _frozen_kernels(gt):
        old = _forward_all(gt, x, chunk, lengths, pieces)
    for name, want in old.items():
        got = new[name]
        if exact:
            assert torch.equal(_bits(got), _bits(want)), (
                f"{case}: {name} differs from the frozen v1 kernels, max |d| {(got - want).abs().max().item():.3e}"
            )
        else:
            assert torch.allclose(got, want, rtol=0, atol=1e-5, equal_nan=True), f"{case}: {name}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES, ids=["qwen3next", "small", "padded"])
def test_blocked_kernels_equal_frozen_v1_bitwise(case):
    from megatron_iso.ops.gdn import gdn_triton

    run_case(gdn_triton, case, "cuda", exact=True)


def _ttgir(fn, consts: dict, warps: int, stages: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = {"chunk_ptr", "chain_ptr"}
    sig = {
        p.name: "constexpr" if p.is_constexpr else ("*i32" if p.name in ints else "*fp32") if p.name.endswith("_ptr")
        else "i32"
        for p in fn.params
    }  # fmt: skip
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    return k.asm["ttgir"]


def _reductions_and_dots(ttgir: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(kind + attributes, operand type with layout aliases resolved) of every tt.reduce / tt.scan, and
    the result layout of every tt.dot."""
    import re

    alias = dict(re.findall(r"^(#[\w]+) = (#ttg\.\w+<.*>)$", ttgir, re.M))

    def resolve(t: str) -> str:
        return re.sub(r"#\w+", lambda m: alias.get(m.group(0), m.group(0)), t)

    red, dots, pending = [], [], None
    for line in ttgir.splitlines():
        m = re.search(r'"tt\.(reduce|scan)"\(%[\w.]+\) <\{([^}]*)\}>', line)
        if m:
            pending = f"{m.group(1)} {m.group(2)}"
        m = re.search(r"^\s*\}\) : \((tensor<[^)]*)\) ->", line)
        if m and pending:
            red.append((pending, resolve(m.group(1))))
            pending = None
        if " tt.dot " in line:
            dots.append(resolve(line.split(" -> ")[-1].split(" loc(")[0]))
    return red, dots


@pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") == "1", reason="compiles for sm_90a (not under the interpreter)"
)
def test_blocking_keeps_reduction_layouts_and_fma_dots():
    """CPU (compile only, sm_90a, Qwen3-Next shape): the parts whose bits depend on the layout, the
    tl.cumsum and tl.sum reductions of the prep kernel, get the same layouts as in v1; every dot is
    still an FMA dot (blocked layout, no tensor-core mma). Elementwise ops do not depend on layouts, and
    each dot's per-element fma chain does not depend on its layout (FMADotUtility.cpp)."""
    from megatron_iso.ops.gdn import gdn_triton as gt

    cfg = gt.config_for(128, 128, 64)
    pc = {"C": 64, "BK": cfg.bk, "BVF": cfg.bv_full}
    cc = {**pc, "BV": cfg.chain_bv}
    for old_fn, new_fn, consts, warps, stages in (
        (v1._prep_kernel, gt._prep_kernel, pc, gt.PREP_WARPS, gt.PREP_STAGES),
        (v1._chain_kernel, gt._chain_kernel, cc, gt.CHAIN_WARPS, gt.CHAIN_STAGES),
    ):
        red_old, dots_old = _reductions_and_dots(_ttgir(old_fn, consts, warps, 3))
        red_new, dots_new = _reductions_and_dots(_ttgir(new_fn, {**consts, "KB": cfg.kb}, warps, stages))
        assert red_new == red_old, (red_old, red_new)
        assert len(dots_new) == len(dots_old) and all("#ttg.blocked<" in d and "mma" not in d for d in dots_new)
