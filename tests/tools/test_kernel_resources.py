"""tools/kernel_resources.py on a CPU machine: the attention forward compiled for sm_90 (Triton's code generator, its
bundled ptxas and cuobjdump) through the launch's own binding. The parked tile is the variant whose point is a key
loop without spills; if a compiler change brings spills back into its loop, this fails here rather than only in a
GPU timing."""

import os
from pathlib import Path

import pytest

from tests.tools.tool_module import load_tool

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under TRITON_INTERPRET=1", allow_module_level=True)

kr = load_tool("kernel_resources")


def test_parked_prefill_tile_has_no_spill_in_its_key_loop() -> None:
    from megatron_iso.ops.attention.forward_launch_triton import AttentionTileConfig

    r = kr.attention_resources("bf16", 128, AttentionTileConfig(64, 4, 2, park=True))
    assert 0 < r.registers <= 255 and r.num_warps == 4, r
    assert r.spill_ops_in_loops == 0, r
    assert 0 < r.shared_bytes <= kr.SM90_SHARED_PER_BLOCK and r.programs_per_sm() >= 1, r
    assert "EXIT" in r.sass and "GMMA" in r.sass  # the SASS comes with it (wgmma dots in a 64-row bf16 tile)


def test_fp32_tile_register_cap_keeps_ptxas_off_32_registers() -> None:
    """fp32 attention's dots are FMA loops; with no register cap ptxas allocates 32 registers and spills kilobytes
    (a 5.4 KB stack at 16 x 4 x 2). The shipped fp32 decode tile carries a cap, and with it the kernel takes more
    registers and a stack under 1 KB (832 B); without the cap the same tile falls back to 32."""
    import torch

    from megatron_iso.ops.attention.forward_launch_triton import DECODE_CONFIGS, AttentionTileConfig

    shipped = DECODE_CONFIGS[torch.float32]
    assert shipped.maxnreg is not None
    capped = kr.attention_resources("fp32", 128, shipped)
    assert capped.registers > 64 and capped.stack_bytes < 1024, capped
    uncapped = kr.attention_resources("fp32", 128, AttentionTileConfig(shipped.block_m, shipped.num_warps, 2))
    assert uncapped.registers == 32 and uncapped.stack_bytes > 4096, uncapped


def test_sass_dir_writes_each_tiles_sass(tmp_path: Path) -> None:
    assert kr.main(["--tile", "bf16:128:16,4,2", "--sass-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.iterdir()
    assert path.name == "bf16_128_16_4_2.sass" and "EXIT" in path.read_text()


def test_programs_per_sm_and_tile_parsing() -> None:
    two = kr.KernelResources(255, 0, 114688, 0, 0, 4)  # 256 regs x 128 threads, 113 KB: two programs
    assert two.programs_per_sm() == 2
    assert kr.KernelResources(255, 0, 147456, 0, 0, 4).programs_per_sm() == 1  # shared memory bound
    assert kr.KernelResources(253, 0, 115200, 0, 0, 8).programs_per_sm() == 1  # register bound
    assert kr.KernelResources(32, 0, 240 * 1024, 0, 0, 4).programs_per_sm() == 0  # over a block's limit
    dtype, dim, cfg = kr._parse_tile("bf16:256:64,8,2,park")
    assert (dtype, dim, cfg.block_m, cfg.num_warps, cfg.num_stages, cfg.park) == ("bf16", 256, 64, 8, 2, True)
    assert not kr._parse_tile("fp32:64:16,4,1")[2].park
    assert kr._parse_tile("fp32:64:16,4,1,r168")[2].maxnreg == 168
    for bad in ("bf16:128:64,4", "bf16:128:64,4,3,parked", "bf16:128", "fp32:64:16,4,1,r1,r2"):
        with pytest.raises(SystemExit, match="expected DTYPE:HEAD_DIM:ROWS,WARPS,STAGES"):
            kr._parse_tile(bad)


def test_tma_gemm_tile_keeps_a_wgmma_in_flight_without_spills() -> None:
    """The leaf-tree GEMM's TMA loop: at 128 x 64 x 64 with 8 warps no spill at all and one wgmma kept in flight
    in the K loop (a wait of 1); the flat loop it is meant to replace waits for every wgmma (only 0)."""
    tma = kr.gemm_resources(1024, 512, 1024, 8, kr._parse_gemm_tile("128x64,8,4,tma,p1"))
    assert tma.stack_bytes == 0 and tma.spill_ops_in_loops == 0, tma
    assert "1" in kr.wgmma_waits(tma.sass).split(","), kr.wgmma_waits(tma.sass)
    flat = kr.gemm_resources(1024, 512, 1024, 8, kr._parse_gemm_tile("128x128,8,4,flat,p0"))
    assert kr.wgmma_waits(flat.sass) == "0"
    cfg = kr._parse_gemm_tile("64x128,4,3,static")
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.loop, cfg.park_from) == (
        64, 128, 4, 3, "static", 0
    )  # fmt: skip
    for bad in ("128x64,8,4", "128x64,8,4,tiled", "128x64,8,4,tma,q1", "128x64,8,4,tma,p1,p2"):
        with pytest.raises(SystemExit, match="expected BMxBN,WARPS,STAGES,LOOP"):
            kr._parse_gemm_tile(bad)


def test_gluon_gemm_tile_keeps_a_wgmma_in_flight_without_spills() -> None:
    """The leaf-tree GEMM's Gluon loop (one TMA pipeline across the leaves): compiled for sm_90 it keeps one wgmma
    in flight (a wait of 1) with no spill, at 8 leaves with the level-0 slot in registers and at one leaf with the
    128 x 256 tile the TMA loop's park buffer could not fit."""
    for tile, leaves in (("128x128,8,4,gluon,p1", 8), ("128x256,8,3,gluon", 1), ("128x128,8,4,gluon,p1", 2)):
        r = kr.gemm_resources(1024, 512, 2048, leaves, kr._parse_gemm_tile(tile))
        assert r.stack_bytes == 0 and r.spill_ops == 0, (tile, leaves, r)
        assert "1" in kr.wgmma_waits(r.sass).split(","), (tile, leaves, kr.wgmma_waits(r.sass))


def test_gluon_loop_refuses_what_it_cannot_run() -> None:
    import torch

    from megatron_iso.ops.gemm.gemm_gluon_triton import gluon_supported

    ok = torch.zeros(64, 256, dtype=torch.bfloat16)
    assert gluon_supported(ok, ok) is None
    assert "bf16 or fp16" in gluon_supported(ok.float(), ok.float())
    assert "16-byte aligned" in gluon_supported(torch.zeros(64, 260, dtype=torch.bfloat16)[:, :250], ok)


def test_scoring_kernel_slices_skip_the_exp_fixup_without_spills() -> None:
    """The scoring pass (``logprob_triton._leaf_kernel``) on bf16 logits at a checked number temperature, compiled for
    sm_90: no spill, registers for 16 one-warp programs an SM, and exps both with the subnormal fix-up (a compare
    with -126 ahead of MUFU.EX2) and without it (``slice_exp_triton``'s flushing form for slices that need none)."""
    import re

    import torch

    from megatron_iso.ops.logprob.logprob_triton import launch_leaf_kernel

    rows, vocab, leaves = 4, 151936, 8
    x = torch.zeros(1, rows, vocab, dtype=torch.bfloat16)
    with kr.compiled_launches() as found:
        launch_leaf_kernel(
            x, torch.ones(rows), torch.empty(1, rows, leaves, 2), vocab, 0, (1.4285713, 4e-8, True), num_warps=1
        )
    r = found["_leaf_kernel"]
    assert r.stack_bytes == 0 and r.spill_ops == 0, r
    assert r.registers <= 128, r  # 65536 / (32 x 128): 16 programs an SM
    ex2 = len(re.findall(r"MUFU\.EX2", r.sass))
    fixups = len(re.findall(r"FSETP\.GEU\.AND P\d, PT, R\d+, -126", r.sass))
    assert fixups > 0 and ex2 >= fixups + 32, (ex2, fixups)  # one warp, 1024 lanes: 32 flushing exps a slice


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("gated", [False, True])
def test_attention_backward_tiles_compile_for_sm90_within_shared_memory(head_dim: int, gated: bool) -> None:
    """The training attention backward's shipped tiles (``backward_triton.backward_tiles``), bf16, compiled for sm_90
    through the launches ``attention_backward`` makes: every kernel compiles and fits an SM's shared memory (128-row
    tiles of a 256-wide head would not: that table keeps 64 x 64), with and without a gate (the statistics kernel
    then stores the fp32 output instead of reducing delta)."""
    import torch

    from megatron_iso.ops.attention.backward_triton import attention_backward

    t, hq, hkv = 256, 8, 2
    q, g = (torch.zeros(t, hq, head_dim, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.zeros(t, hkv, head_dim, dtype=torch.bfloat16) for _ in range(2))
    gate = torch.zeros(t, hq, head_dim, dtype=torch.bfloat16) if gated else None
    with kr.compiled_launches() as found:
        attention_backward(q, k, v, g, torch.tensor([0, 100, t]), 156, head_dim**-0.5, gate)
    assert set(found) == {"_stats_kernel", "_dkdv_kernel", "_dq_kernel"}, sorted(found)
    for name, r in found.items():
        assert 0 < r.shared_bytes <= kr.SM90_SHARED_PER_BLOCK and r.programs_per_sm() >= 1, (name, r)
        assert "GMMA" in r.sass or "HMMA" in r.sass, name  # tensor-core dots
