"""RoPE in Triton (GPU correctness profile): ``apply_rope`` and ``rope_cos_sin``, one kernel each,
bitwise equal to ``megatron_iso.ops.rope.reference``.

``apply_rope``: the reference's float32 ``x_rot * cos + rotate_half(x_rot) * sin`` (two products and
a sum, each rounded; ``rotate_half``'s negation is a sign flip), rounded to ``x.dtype`` once, the
pass-through channels copied. Compiled without FMA contraction, so ``a * b + c`` keeps its two
roundings. ``rope_cos_sin``: the float64 angle ``position * inv_freq`` and the Cody-Waite + Taylor
``ieee_math.sincos64``, through ``common.ieee_math_triton.sincos64``, rounded to float32.
The per-config ``inv_freq`` table is the reference's (Python floats), cached per device; the range
check is the reference's, on a host bound when the caller has one (no host sync then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.ieee_math_triton import NO_FMA, f32_to, neg, sincos64, to_f32
from megatron_iso.ops.rope.reference import check_position, inv_frequencies_on, max_abs_position
from megatron_iso.registry import OpImpl, Profile, register

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE = 2048  # elements per program (heads x head_dim); launch shape only, never changes a bit


@triton.jit
def _apply_rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, H, D, stride_xt, stride_xh, stride_ct, stride_st,
    ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    HALF: tl.constexpr = ROT // 2
    in_row = (hs < H)[:, None]
    mask = in_row & (ds < D)[None, :]
    rot = ds < ROT
    row = t * stride_xt + hs[:, None].to(tl.int64) * stride_xh
    x = tl.load(x_ptr + row + ds[None, :], mask=mask, other=0.0)
    # rotate_half: channel j < HALF pairs with -x[j + HALF], channel HALF <= j < ROT with x[j - HALF].
    partner = tl.where(ds < HALF, ds + HALF, ds - HALF)
    xp = tl.load(x_ptr + row + partner[None, :], mask=in_row & rot[None, :], other=0.0)
    xp = to_f32(xp)
    rotated = tl.where((ds < HALF)[None, :], neg(xp), xp)
    c = tl.load(cos_ptr + t * stride_ct + ds, mask=rot, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + ds, mask=rot, other=0.0)
    out = f32_to(to_f32(x) * c[None, :] + rotated * s[None, :], y_ptr.dtype.element_ty)
    # Channels past ROT are copied as they are (torch.cat of the untouched slice).
    out = tl.where(rot[None, :], out, x)
    tl.store(y_ptr + (t * H + hs[:, None].to(tl.int64)) * D + ds[None, :], out, mask=mask)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[tokens, heads, head_dim]``; same bits as the reference."""
    if x.dim() != 3 or cos.dim() != 2 or cos.shape[0] != x.shape[0]:
        raise ValueError(f"apply_rope: x [T, H, D] and cos [T, rot] expected, got {tuple(x.shape)}, {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"apply_rope: sin {tuple(sin.shape)} != cos {tuple(cos.shape)}")
    rot = cos.shape[-1]
    if rot > x.shape[-1] or rot % 2:
        raise ValueError(f"apply_rope: rotary_dim {rot} invalid for head_dim {x.shape[-1]}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"apply_rope_triton: unsupported x dtype {x.dtype}; supported {SUPPORTED_DTYPES}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"apply_rope_triton: cos/sin must be float32 (rope_cos_sin), got {cos.dtype}/{sin.dtype}")
    T, H, D = x.shape
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_d = triton.next_power_of_2(D)
    block_h = min(triton.next_power_of_2(H), max(1, _TILE // block_d))
    _apply_rope_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, y, H, D, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        ROT=rot, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, **NO_FMA,
    )  # fmt: skip
    return y


@triton.jit
def _rope_cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, P, HALF: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_F: tl.constexpr):  # fmt: skip
    ps = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    fs = tl.arange(0, BLOCK_F)
    pm = ps < P
    fm = fs < HALF
    mask = pm[:, None] & fm[None, :]
    pos = tl.load(pos_ptr + ps, mask=pm, other=0).to(tl.float64)
    inv = tl.load(inv_ptr + fs, mask=fm, other=0.0)
    sin, cos = sincos64(pos[:, None] * inv[None, :])
    # Layout cat(f, f): the same value at channel j and j + HALF.
    base = ps[:, None].to(tl.int64) * (2 * HALF) + fs[None, :]
    c32 = cos.to(tl.float32)
    s32 = sin.to(tl.float32)
    tl.store(cos_ptr + base, c32, mask=mask)
    tl.store(cos_ptr + base + HALF, c32, mask=mask)
    tl.store(sin_ptr + base, s32, mask=mask)
    tl.store(sin_ptr + base + HALF, s32, mask=mask)


def rope_cos_sin_triton(
    positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0, *, max_position: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` of shape ``[*positions.shape, rotary_dim]``; same bits as ``reference.rope_cos_sin``.

    ``max_position``: host bound on ``|positions|`` (``IsoBatch.max_position``); without it the
    range check reads the positions back (one host sync).
    """
    if positions.is_floating_point():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    check_position(max_abs_position(positions) if max_position is None else max_position)
    inv = inv_frequencies_on(int(rotary_dim), float(theta), positions.device)
    shape = (*positions.shape, rotary_dim)
    cos = torch.empty(shape, dtype=torch.float32, device=positions.device)
    sin = torch.empty(shape, dtype=torch.float32, device=positions.device)
    if positions.numel() == 0:
        return cos, sin
    flat = positions.reshape(-1).contiguous()
    half = rotary_dim // 2
    block_f = triton.next_power_of_2(half)
    block_p = max(1, min(64, 1024 // block_f))
    _rope_cos_sin_kernel[(triton.cdiv(flat.numel(), block_p),)](
        flat, inv, cos, sin, flat.numel(), HALF=half, BLOCK_P=block_p, BLOCK_F=block_f, num_warps=4, **NO_FMA
    )
    return cos, sin


def _probe_apply() -> dict[str, torch.Tensor]:
    # The reference probe's inputs (CPU generator), so the digests are comparable.
    g = torch.Generator().manual_seed(4002)
    x = torch.randn(6, 2, 32, generator=g).cuda()
    pos = torch.tensor([0, 1, 63, 64, 4095, 131071]).cuda()
    out = {}
    for frac, rd in (("full", 32), ("quarter", 8)):
        cos, sin = rope_cos_sin_triton(pos, rd, 10000.0)
        out[f"{frac}_fp32"] = apply_rope_triton(x, cos, sin).cpu()
        out[f"{frac}_bf16"] = apply_rope_triton(x.bfloat16(), cos, sin).cpu()
    return out


def _probe_cos_sin() -> dict[str, torch.Tensor]:
    pos = torch.tensor([0, 1, 2, 63, 64, 65, 1000, 4095, 32767, 131071, 1000003]).cuda()
    cos, sin = rope_cos_sin_triton(pos, 64, 1_000_000.0)
    return {"cos": cos.cpu(), "sin": sin.cpu()}


_EQUALITY = "bitwise equal to the torch reference (same fp64 op sequence, no FMA contraction)"
register(
    OpImpl(
        op="rope_cos_sin",
        impl_id="rope_cos_sin.triton",
        version="1",
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=rope_cos_sin_triton,
        constants={
            "inv_freq": "fp64 python theta ** (-2i/rotary_dim)",
            "angle": "fp64 position * inv_freq",
            "sincos": "fp64 cody-waite pi/2 (2 parts) + taylor deg 17/16, rounded to fp32",
            "layout": "hf rotate_half: cat(f, f)",
            "equality": _EQUALITY,
            "fp_fusion": False,
            "triton": triton.__version__,
        },
        probe=_probe_cos_sin,
    )
)
register(
    OpImpl(
        op="rope",
        impl_id="rope.triton",
        version="1",
        device_class="cuda",
        profile=Profile.CORRECTNESS,
        fn=apply_rope_triton,
        constants={
            "accumulate_dtype": "fp32",
            "layout": "hf rotate_half (non-interleaved)",
            "output_rounding": "once",
            "equality": "bitwise equal to the torch reference (fp32 x*cos + rotate_half(x)*sin, no FMA contraction)",
            "fp_fusion": False,
            "triton": triton.__version__,
        },
        probe=_probe_apply,
    )
)
