"""GEMM op family: one dispatch point over (device class, profile).

| device | profile      | implementation                                              |
|--------|--------------|-------------------------------------------------------------|
| cpu    | correctness  | ``reference.leaf_tree_linear_forward`` (elementwise tree, invariant) |
| cuda   | correctness  | ``gemm_triton.leaf_tree_linear_triton`` (imported lazily)    |
| any    | performance  | ``native.native_linear`` (library GEMM in the input dtype)   |

Every path returns fp32 so that a row-parallel caller can hand partials to the tree collectives.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.common.dispatch import select
from megatron_iso.ops.gemm.backend import Linear
from megatron_iso.ops.gemm.native import native_linear
from megatron_iso.ops.gemm.reference import (
    DEFAULT_LEAVES,
    SUPPORTED_DTYPES,
    apply_with_matmul_backward,
    check_dtype,
    leaf_tree_linear,
    leaf_tree_linear_forward,
    validate_leaves,
)
from megatron_iso.registry import OpImpl, Profile, register, register_per_device

OP = "gemm"
REFERENCE_ID, REFERENCE_VERSION = "leaf_tree_gemm.reference", "1"
NATIVE_ID, NATIVE_VERSION = "gemm.native", "1"

__all__ = [
    "DEFAULT_LEAVES",
    "OP",
    "SUPPORTED_DTYPES",
    "check_dtype",
    "leaf_tree_linear",
    "linear",
    "native_linear",
    "validate_leaves",
]


TRITON_MODULE = "megatron_iso.ops.gemm.gemm_triton"


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    leaves: int = DEFAULT_LEAVES,
    profile: str = Profile.CORRECTNESS,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` (weight in Megatron layout [N, K]) by the registered implementation serving
    ``x``'s device class and ``profile`` (so a registry swap, e.g. by iso-gate, reaches every linear layer).
    fp32, or rounded once to ``out_dtype`` (the same bits as ``linear(...).to(out_dtype)``; a kernel that
    can round as it stores skips the fp32 tensor). Differentiable: correctness kernels get the
    deterministic matmul backward, which then receives its gradient in ``out_dtype``."""
    if profile not in (Profile.CORRECTNESS, Profile.PERFORMANCE):
        raise ValueError(f"profile={profile!r}; expected 'correctness' or 'performance'")
    kernel: Linear = select(OP, x, profile, TRITON_MODULE)
    if profile == Profile.PERFORMANCE:
        out = kernel(x, weight)  # library matmul, its own autograd
        return out if out_dtype is None else out.to(out_dtype)
    check_dtype(x, "x")
    check_dtype(weight, "weight")
    validate_leaves(leaves, k=weight.shape[1])
    rounded = out_dtype is not None and out_dtype != torch.float32

    def forward(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
        # Registered correctness kernels take 2-D rows: fp32 [M, K] x [N, K] -> [M, N].
        n, k = weight.shape
        rows = x.reshape(-1, k)
        if not rounded:
            out = kernel(rows, weight, leaves)
        elif getattr(kernel, "rounds_output", False):
            out = kernel(rows, weight, leaves, out_dtype=out_dtype)
        else:
            out = kernel(rows, weight, leaves).to(out_dtype)
        return out.reshape(*x.shape[:-1], n)

    return apply_with_matmul_backward(forward, x, weight, leaves)


def _probe_inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(7, 64, generator=g)
    w = torch.randn(24, 64, generator=g) / 8
    return x.to(device), w.to(device)


def _probe_reference() -> dict[str, torch.Tensor]:
    x, w = _probe_inputs("cpu")
    return {
        "fp32": leaf_tree_linear_forward(x, w, DEFAULT_LEAVES),
        "bf16": leaf_tree_linear_forward(x.bfloat16(), w.bfloat16(), DEFAULT_LEAVES),
    }


def _probe_native(device: str):
    def probe() -> dict[str, torch.Tensor]:
        x, w = _probe_inputs(device)
        return {"fp32": native_linear(x, w), "bf16": native_linear(x.bfloat16(), w.bfloat16())}

    return probe


register(
    OpImpl(
        op=OP,
        impl_id=REFERENCE_ID,
        version=REFERENCE_VERSION,
        device_class="cpu",
        profile=Profile.CORRECTNESS,
        fn=leaf_tree_linear_forward,
        # The leaves count itself is a per-layer setting (config.iso_leaves), recorded by the contract.
        constants={
            "default_leaves": DEFAULT_LEAVES,
            "accumulate": "fp32",
            "product": "fp32_elementwise",
            "intra_leaf": "balanced_tree",
            "leaf_combine": "balanced_tree",
        },
        probe=_probe_reference,
    )
)
register_per_device(
    op=OP,
    impl_id=NATIVE_ID,
    version=NATIVE_VERSION,
    profile=Profile.PERFORMANCE,
    fn=native_linear,
    constants={"algorithm": "library_matmul", "accumulate": "library"},
    probe_for=_probe_native,
)
