"""SwiGLU in Triton (GPU correctness profile): one kernel, bitwise equal to ``reference.swiglu``.

The torch reference runs ``silu(gate) * up`` as ~40 separate float64 elementwise kernels (the exp
polynomial, the sigmoid, the products), each rounding its result; on a GPU that is ~1.5 ms of CPU
launch time per MLP call. This kernel performs the same float64 operations in the same order
(``ieee_math_triton``), compiled without FMA contraction, then rounds to float32 and then to the
input dtype, as the reference does. Elementwise, so batch invariant by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.ieee_math_triton import NO_FMA, f32_to, sigmoid64, to_f32
from megatron_iso.registry import OpImpl, Profile, register

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 1024  # elements per program along the row; a launch constant that never changes a bit


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    g = to_f32(g).to(tl.float64)  # exact widenings, as gate.double()
    u = to_f32(u).to(tl.float64)
    # reference: (g * sigmoid64(g) * up).float().to(dtype): left to right, two final roundings.
    y = ((g * sigmoid64(g)) * u).to(tl.float32)
    tl.store(y_ptr + row * N + offs, f32_to(y, y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last] with unit inner stride; a view when possible (chunked halves stay views)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the input dtype; same signature and bits as ``reference.swiglu``."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} differ")
    if gate.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"swiglu_triton: unsupported dtype {gate.dtype}; supported {SUPPORTED_DTYPES}")
    if gate.device != up.device:
        raise ValueError(f"swiglu_triton: gate on {gate.device}, up on {up.device}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    if gate.dim() == 0:
        return swiglu_triton(gate.reshape(1), up.reshape(1)).reshape(())
    g2, u2 = _rows(gate), _rows(up)
    rows, n = g2.shape
    _swiglu_kernel[(rows, triton.cdiv(n, _BLOCK))](
        g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK=_BLOCK, num_warps=4, **NO_FMA
    )
    return out


@triton.jit
def _swiglu_bwd_kernel(
    g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, N, stride_g, stride_u, stride_dy, stride_dg, stride_du, BLOCK: tl.constexpr
):  # fmt: skip
    """dgate = dy * up * silu'(gate), dup = dy * silu(gate); fp32, one rounding per output (deterministic, not
    invariant: the backward's only requirement)."""
    i_r = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    b_g = tl.load(g_ptr + i_r * stride_g + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_u = tl.load(u_ptr + i_r * stride_u + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_dy = tl.load(dy_ptr + i_r * stride_dy + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_s = 1.0 / (1.0 + tl.exp(-b_g))
    b_du = b_dy * (b_g * b_s)
    b_dg = b_dy * b_u * (b_s + b_g * b_s * (1.0 - b_s))
    tl.store(dg_ptr + i_r * stride_dg + o_n, b_dg.to(dg_ptr.dtype.element_ty), mask=m_n)
    tl.store(du_ptr + i_r * stride_du + o_n, b_du.to(du_ptr.dtype.element_ty), mask=m_n)


def _swiglu_backward_into(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dg: torch.Tensor, du: torch.Tensor):
    g2, u2, dy2, dg2, du2 = (_rows(t) for t in (gate, up, dy, dg, du))
    rows, n = g2.shape
    if rows and n:
        _swiglu_bwd_kernel[(rows, triton.cdiv(n, _BLOCK))](
            g2, u2, dy2, dg2, du2, n, g2.stride(0), u2.stride(0), dy2.stride(0), dg2.stride(0), du2.stride(0),
            BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` of ``silu(gate) * up`` in one pass (the plain form's autograd is ~8 passes)."""
    dg, du = torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(up)
    _swiglu_backward_into(dy.contiguous(), gate, up, dg, du)
    return dg, du


def swiglu_packed_backward(dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
    """Gradient of ``silu(x[..., :n]) * x[..., n:]`` written straight into one ``[..., 2n]`` buffer (no cat)."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    gate, up = torch.chunk(x, 2, dim=-1)
    dg, du = torch.chunk(dx, 2, dim=-1)
    _swiglu_backward_into(dy.contiguous(), gate, up, dg, du)
    return (dx,)


def _probe() -> dict[str, torch.Tensor]:
    # The reference probe's inputs (CPU generator), so the digests are comparable.
    g = torch.Generator().manual_seed(4003)
    a, b = (torch.randn(2, 7, 48, generator=g) * 4).cuda()
    return {"fp32": swiglu_triton(a, b).cpu(), "bf16": swiglu_triton(a.bfloat16(), b.bfloat16()).cpu()}


register(
    OpImpl(
        op="swiglu",
        impl_id="swiglu.triton",
        version="1",
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=swiglu_triton,
        constants={
            "compute_dtype": "fp64 IEEE-composed silu * up (ieee_math_triton)",
            "output_rounding": "fp32 then input dtype",
            "equality": "bitwise equal to the torch reference (same fp64 op sequence, no FMA contraction)",
            "fp_fusion": False,
            "backward": "swiglu backward kernel: fp32, one rounding per output",
            "triton": triton.__version__,
        },
        probe=_probe,
    )
)
