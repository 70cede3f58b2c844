"""The Triton leaf-tree GEMMs' tile config, and their K-tile depth per input dtype: the one constant both the
kernels' tile configs and the contract's build-time check read.

Every tile of a dtype shares this BLOCK_K (that is what makes tiles bitwise-equivalent), and a leaf
is walked in whole K tiles, so on the GPU every GEMM's leaf depth (K / leaves) must be a multiple of it.
"""

from __future__ import annotations

from dataclasses import dataclass

TRITON_BLOCK_K: dict[str, int] = {"bf16": 64, "fp16": 64, "fp32": 32}


@dataclass(frozen=True)
class GemmTileConfig:
    """Everything that fixes the instruction sequence of one leaf (keyed into the contract)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # Tree levels at or above this are parked in fp32 global scratch; below it they stay in registers.
    park_from: int = 0
    # "static": each leaf its own pipelined K loop (leaves unrolled); "flat": one pipelined loop over all
    # K-tiles of the subtree with the tree step predicated at leaf ends (no pipeline drain per leaf); "tma": a
    # pipelined K loop per leaf over TMA descriptor loads, the leaves in a loop (ops/gemm/gemm_tma_triton.py);
    # "gluon": one explicit TMA pipeline across the leaves, an asynchronous wgmma per K tile (ops/gemm/gemm_gluon_triton.py).
    loop: str = "flat"
    # fp32 inputs: "ieee" (exact fp32 products, FMA path). tf32 would change the function.
    fp32_precision: str = "ieee"

    def __post_init__(self) -> None:
        if self.loop not in LOOPS:
            raise ValueError(f"GemmTileConfig: loop={self.loop!r} must be one of {LOOPS}")


LOOPS = ("static", "flat", "tma", "gluon")
