"""RMSNorm in Triton (GPU correctness profile): plain, zero-centred ``x̂·(1+w)`` and gated ``norm(x)·w·silu(z)``.

One row per program with a block that covers the whole hidden dim, so a row's reduction (``tl.sum`` of
``x*x`` over a fixed block and fixed warp count, both chosen from the hidden size only) is the same
instruction sequence whatever the number of rows: batch invariant. All math is fp32 with correctly
rounded ``sqrt`` and ``/`` (``sqrt_rn``, ``div_rn``: the default Triton division is approximate), and the
output is rounded to ``x.dtype`` once. Signatures match ``megatron_iso.ops.norm.reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.rows import strided_rows
from megatron_iso.registry import OpImpl, Profile, register

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HIDDEN = 65536


def _block_and_warps(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    return block, min(16, max(1, block // 512))


@triton.jit
def _rms_norm_kernel(
    x_ptr, g_ptr, w_ptr, y_ptr, H, stride_x, g_heads, g_stride_token, g_stride_head, stride_y, eps,
    ZERO_CENTERED: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row; the gate's row ``r`` is head ``r % g_heads`` of token ``r // g_heads`` at the gate's own strides (the
    GDN layer's z is a column slice of its input projection, read in place)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        # The gate's read and silu ahead of the row reduction: they overlap x's read and the reduction's barriers
        # instead of starting after them (the same operations on the same values).
        g_row = (row // g_heads) * g_stride_token + (row % g_heads) * g_stride_head
        g = tl.load(g_ptr + g_row + offs, mask=mask, other=0.0).to(tl.float32)
        silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    ms = tl.math.div_rn(tl.sum(x * x, axis=0), H.to(tl.float32))
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    y = (x * inv) * w
    if GATED:
        y = y * silu
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _run(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centered: bool):
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm_triton: unsupported dtype {x.dtype}; supported {SUPPORTED_DTYPES}")
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"rms_norm_triton: weight shape {tuple(weight.shape)} != (hidden,) = ({H},)")
    if H > MAX_HIDDEN:
        raise ValueError(f"rms_norm_triton: hidden size {H} > {MAX_HIDDEN} (one row per program)")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm_triton: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if gate is None:
        g2, g_heads, g_token, g_head = x2, 1, x2.stride(0), 0
    else:
        g2, g_heads, g_token, g_head = strided_rows(gate if gate.dim() in (2, 3) else gate.reshape(-1, H))
    y = torch.empty((x2.shape[0], H), device=x.device, dtype=x.dtype)
    if x2.shape[0] == 0:
        return y.reshape(x.shape)
    block, warps = _block_and_warps(H)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, g2, weight.contiguous(), y, H, x2.stride(0), g_heads, g_token, g_head, y.stride(0), float(eps),
        ZERO_CENTERED=zero_centered, GATED=gate is not None, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return y.reshape(x.shape)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, zero_centered: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim: ``x̂ * w`` (or ``x̂ * (1 + w)``); same signature as ``reference.rms_norm``."""
    return _run(x, None, weight, eps, zero_centered)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, zero_centered: bool = False
) -> torch.Tensor:
    """``rms_norm(x) * silu(gate)`` with one rounding; same signature as ``reference.gated_rms_norm``."""
    return _run(x, gate, weight, eps, zero_centered)


def _probe_inputs():
    g = torch.Generator().manual_seed(4001)
    return (torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g) * 0.1)


def _probe_plain() -> dict[str, torch.Tensor]:
    x, _, w = (t.cuda() for t in _probe_inputs())
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[f"plain_{name}"] = rms_norm_triton(x.to(dt), w.to(dt)).cpu()
        out[f"zero_centered_{name}"] = rms_norm_triton(x.to(dt), w.to(dt), zero_centered=True).cpu()
    return out


def _probe_gated() -> dict[str, torch.Tensor]:
    x, z, w = (t.cuda() for t in _probe_inputs())
    return {
        n: gated_rms_norm_triton(x.to(d), z.to(d), w.to(d)).cpu()
        for n, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }


_CONSTANTS = {
    "accumulate_dtype": "fp32",
    "reduction": "one row per program; tl.sum over next_pow2(hidden) block; warps = min(16, max(1, block // 512))",
    "sqrt_div": "sqrt_rn, div_rn",
    "exp": "tl.exp (fp32)",
    "output_rounding": "once, to input dtype",
    "backward": "norm_backward_triton: one fp32 pass, fixed row blocks per program, partial dw summed in fixed order",
    "triton": triton.__version__,
}
register(OpImpl(op="rmsnorm", impl_id="rmsnorm.triton", version="1", device_class="cuda", profile=Profile.CORRECTNESS,
                fn=rms_norm_triton, constants=_CONSTANTS, probe=_probe_plain))  # fmt: skip
register(OpImpl(op="rmsnorm_gated", impl_id="rmsnorm_gated.triton", version="1", device_class="cuda",
                profile=Profile.CORRECTNESS, fn=gated_rms_norm_triton, constants=_CONSTANTS, probe=_probe_gated))  # fmt: skip
