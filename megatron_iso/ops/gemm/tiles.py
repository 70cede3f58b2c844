"""K-tile depth of the Triton leaf-tree GEMMs per input dtype: the one constant both the kernels'
tile configs and the contract's build-time check read.

Every tile of a dtype shares this BLOCK_K (that is what makes tiles bitwise-equivalent), and a leaf
is walked in whole K tiles, so on the GPU every GEMM's leaf depth (K / leaves) must be a multiple of it.
"""

from __future__ import annotations

TRITON_BLOCK_K: dict[str, int] = {"bf16": 64, "fp16": 64, "fp32": 32}
