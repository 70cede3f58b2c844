"""Tuning constants, precisions and output forms, :class:`GDNConfig` (what fixes the kernels' instruction sequences),
and the launch-option helpers and the dot every kernel of the package shares.

The constants are read when a call is planned or launched (``tuning.NAME``), so ``tools/bench_gdn.py --tune`` and the
tests may override them on this module for a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.ieee_math_triton import NO_FMA
from megatron_iso.ops.common.interpret import INTERPRET
from megatron_iso.ops.gdn.state_cache import OUTPUT_FORMS

# Dv block of the scan and chain programs (the Dv split is exact: columns of S are independent).
# Under the interpreter a small block, so tiny test shapes still cover several Dv blocks.
SCAN_BV = 4 if INTERPRET else 32
# The chain's Dv block per dot path: 16 for ieee (K-blocked through memory), 32 for tf32x3 and tf32 (whole-K dots from
# registers, faster than 16), 64 for bf16 operands (faster than 32).
CHAIN_BV = 4 if INTERPRET else 16
CHAIN_BV_MMA = 4 if INTERPRET else 32
CHAIN_BV_BF16 = 4 if INTERPRET else 64
MIN_DOT = 1 if INTERPRET else 16  # tl.dot needs every dimension >= 16 on the GPU
# K block of the state-pass dots (docs/GDN.md, "K-blocked dots"); small under the interpreter so tiny shapes still
# run several blocks.
DOT_KB = 4 if INTERPRET else 16
# Row block of the prep kernel's triangular inverse (docs/GDN.md, "Triangular inverse"): diagonal blocks by row
# substitution, all at once; the blocks below by K-blocked dots. Small under the interpreter so tiny chunks still
# have several blocks.
INV_BLOCK = 4 if INTERPRET else 16
# Warps per program; the prep kernel is faster in 4 warps than in 8 at every dot precision.
SCAN_WARPS, CHAIN_WARPS, PREP_WARPS = 2, 4, 4
# Software-pipelining depth of the K-block loops (bit-neutral: it only moves loads). Triton's default 3 spills in both
# kernels at Dk = Dv = 128, chunk 64 (``tools/bench_gdn.py --resources``).
PREP_STAGES, CHAIN_STAGES = 1, 2
# input_precision of the state pass's fp32 tl.dot (the scan has no dot). "ieee" lowers to FMA chains (no tensor
# cores); "tf32x3" (3 tf32 MMAs per product, ~fp32 accuracy) and "tf32" use tensor cores. Any of them keeps
# training == rollout bitwise: both sides run the same kernel on the same closed chunk (docs/GDN.md, "Dot
# precision"). A spec is one of DOT_PRECISIONS for both kernels, or "PREP/CHAIN". The default is the one the
# contract registers, "ieee/tf32x3": the prep kernel's dots stay FMA chains (tensor cores do not make the prep faster),
# the chain's two whole-K dots per chunk run on tensor cores (several times faster), with the same error against fp64.
# The others are opt-in per call.
DOT_PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16")  # bf16: operands rounded to bf16, fp32 accumulate (FLA's class)
DOT_PRECISION = "ieee/tf32x3"
# How a chunk's outputs are computed (GDNConfig.form; docs/GDN.md, "Output forms"): "scan", the per-token
# recurrence from the chunk's entry state (the registered default; decode is one scan step), or "chunk", output tiles
# O = e^G (Q E) + P u on tensor cores (training and prefill fast; decode computes its token's rows of those tiles).
FORMS = OUTPUT_FORMS
FORM = "scan"
# The chunk form's decode step computes its token's rows through 16-row tiles, so it takes only the precisions whose
# row bits do not follow the tile's row count: ieee, tf32 and bf16 hold train == rollout at chunk 64,
# Dk = Dv = 128; tf32x3 does not (tests/gpu/test_gdn_triton.py).
CHUNK_FORM_PRECISIONS = ("ieee", "tf32", "bf16")
CHUNK_DOT_PRECISION = "bf16"  # the chunk form's precision when a call names none
# Dv block of the chunk-form output kernel: all of Dv (faster than 64 or 32)
OUT_BV = 4 if INTERPRET else 128
# With bf16 chain dots, the state pass's intermediates that only ever enter those dots (W, KD; chunk form: u and the
# entry states) are stored as bf16, the value the dot would round them to: the same bits, half the bytes
# ("Dot precision" in docs/GDN.md). False: fp32 storage, for the test that holds the bits equal.
MID_BF16 = True
OUT_WARPS = 4
# Rows of A, P and of the output tiles in a chunk-form decode step: the 16 rows holding the token (tl.dot's
# minimum). Under the interpreter the whole chunk, rows at their true positions: numpy's matmul bits follow M and the
# row's position, the GPU's do not.
DECODE_ROWS = 0 if INTERPRET else 16  # 0: the chunk
# The chunk-form decode row kernel's Dv block and warps, and the decode prep's warps. The Dv split is bit-neutral
# for every dot precision, ieee included, because every chunk-form kernel launches without fp contraction
# (fp_options): with it, LLVM fused the row kernel's ``beta v - (beta e^G k) E`` into one fma at block 64 where the
# chain subtracts from the prep's rounded ``beta v``. Block 32 (4 programs per value head) is slower.
DECODE_BV = 4 if INTERPRET else 64
DECODE_WARPS, DECODE_PREP_WARPS = 4, 4
# A decode step's substitution sum (``sum_{j<b} A_tj u_j``) as one dot over the chunk with A's columns from the token's
# block on zero, where the chain runs one 16-column dot per earlier block: on the GPU a whole-K dot whose A is zero
# from column 16 nb on has the bits of nb block dots accumulated in ascending order at tf32 and bf16 (the chunk-form GPU
# tests hold it). It reads u's earlier rows once (the output reads them too), which makes the row kernel faster. Not
# at ieee, where the step keeps the chain's block dots; nor under the interpreter, whose numpy dot bits follow K.
DECODE_SUM_ONE_DOT = not INTERPRET
# Register caps (ptxas .maxnreg) per kernel, 0: ptxas' own choice. A cap trades spills for programs per SM; it changes
# no arithmetic. Not passed under the interpreter. Both decode kernels are capped (168 registers: 3 programs per SM
# instead of 2; the decode prep at 128: 4 per SM, no spills), which makes a decode step faster. The training kernels
# stay uncapped: capped at 168, the prep and the backward's local, output and WY kernels made training slower.
PREP_MAXNREG, CHAIN_MAXNREG, OUT_MAXNREG, SCAN_MAXNREG = 0, 0, 0, 0
DECODE_MAXNREG, DECODE_PREP_MAXNREG = 168, 128
CHUNK_COLS = 5  # columns of a plan's chunk table (_prep_kernel's docstring)
CONV_BC = 256  # channels per conv program
CONV_BWD_BT, CONV_BWD_BC = 64, 128  # rows and channels per conv backward program (fixed: the weight gradient's order)
ELEM_BLOCK = 1024  # elements per gates program


@dataclass(frozen=True)
class GDNConfig:
    """Everything that fixes the kernels' instruction sequences: chosen from (Dk, Dv, chunk) only."""

    bk: int  # padded Dk
    bv_full: int  # padded Dv (prep kernel: the whole value dim)
    scan_bv: int
    chain_bv: int
    chunk: int
    kb: int  # K block of the prep/chain dots (divides chunk and bk; bit-neutral: docs/GDN.md)
    inv_block: int  # row block of the prep kernel's triangular inverse (divides chunk)
    prep_precision: str  # input_precision of the prep kernel's tl.dot (one of DOT_PRECISIONS)
    chain_precision: str  # input_precision of the chain kernel's tl.dot (one of DOT_PRECISIONS)
    form: str = FORM  # "scan" or "chunk" (FORMS); the chunk-form output kernel's dots use chain_precision
    out_bv: int = OUT_BV
    mid_bf16: bool = False  # W, KD (chunk form: u, entry states) stored as bf16: MID_BF16 with bf16 chain dots
    decode_bv: int = DECODE_BV  # Dv block of the chunk-form decode row kernel

    @property
    def mid_dtype(self) -> torch.dtype:
        """Storage of W and KD (and in the chunk form of u and the entry states)."""
        return torch.bfloat16 if self.mid_bf16 else torch.float32

    @property
    def dot_precision(self) -> str:
        """The spec these two came from (:func:`split_dot_precision` inverts it)."""
        if self.prep_precision == self.chain_precision:
            return self.prep_precision
        return f"{self.prep_precision}/{self.chain_precision}"


def split_dot_precision(spec: str) -> tuple[str, str]:
    """``"P"`` -> (P, P); ``"P/C"`` -> (P, C): the prep and chain kernels' ``input_precision``."""
    parts = spec.split("/") if isinstance(spec, str) else [spec]
    if len(parts) not in (1, 2) or any(p not in DOT_PRECISIONS for p in parts):
        raise ValueError(
            f"gated_delta_rule (triton): dot_precision={spec!r} must be one of {list(DOT_PRECISIONS)} "
            f"or 'PREP/CHAIN' with each one of them (e.g. 'ieee/tf32x3')"
        )
    return parts[0], parts[-1]


def _mid_bf16(chain_precision: str) -> bool:
    """Whether W, KD (chunk form: u, entry states) are stored as bf16: ``MID_BF16`` with bf16 chain dots."""
    return bool(MID_BF16) and chain_precision == "bf16"


def config_for(dk: int, dv: int, chunk: int, dot_precision: str = DOT_PRECISION, form: str = FORM) -> GDNConfig:
    prep_precision, chain_precision = split_dot_precision(dot_precision)
    if form not in FORMS:
        raise ValueError(f"gated_delta_rule (triton): form={form!r} must be one of {list(FORMS)}")
    if form == "chunk" and {prep_precision, chain_precision} - set(CHUNK_FORM_PRECISIONS):
        raise ValueError(
            f"gated_delta_rule (triton): form='chunk' with dot_precision={dot_precision!r}: the chunk form takes "
            f"{list(CHUNK_FORM_PRECISIONS)} (or 'PREP/CHAIN' of them); tf32x3's row bits move with the tile's row count"
        )
    if chunk < MIN_DOT or chunk & (chunk - 1):
        raise ValueError(
            f"gated_delta_rule (triton): chunk={chunk} must be a power of two >= {MIN_DOT} "
            "(tl.dot tiles; profile.gdn_chunk)"
        )
    bk = max(MIN_DOT, triton.next_power_of_2(dk))
    bvf = max(MIN_DOT, triton.next_power_of_2(dv))
    kb = min(DOT_KB, chunk, bk)
    inv_block = min(INV_BLOCK, chunk)
    chain_bv = {"ieee": CHAIN_BV, "bf16": CHAIN_BV_BF16}.get(chain_precision, CHAIN_BV_MMA)
    chain_bv = max(MIN_DOT, min(chain_bv, bvf))
    out_bv = max(MIN_DOT, min(OUT_BV, bvf))
    return GDNConfig(
        bk, bvf, min(SCAN_BV, bvf), chain_bv, chunk, kb, inv_block, prep_precision, chain_precision, form, out_bv,
        mid_bf16=_mid_bf16(chain_precision), decode_bv=max(MIN_DOT, min(DECODE_BV, bvf)),
    )  # fmt: skip


def chunk_u_dtype(dot_precision: str | None = None) -> torch.dtype:
    """The dtype the chunk form stores u in at ``dot_precision`` (None: the chunk form's default): what a chunk-form
    state cache's ``buf_u`` may be allocated in (GDNLayerState.allocate's u_dtype) at half the bytes of fp32."""
    return torch.bfloat16 if _mid_bf16(split_dot_precision(dot_precision or CHUNK_DOT_PRECISION)[1]) else torch.float32


def state_u_dtype(form: str, dot_precision: str | None = None) -> torch.dtype:
    """``buf_u``'s dtype for a state cache of ``form`` (GDNLayerState.allocate's u_dtype): :func:`chunk_u_dtype` in the
    chunk form, fp32 in the scan form (its buf_u is not read)."""
    return chunk_u_dtype(dot_precision) if form == "chunk" else torch.float32


def form_dot_precision(form: str, dot_precision: str | None = None) -> str:
    """``dot_precision``, or ``form``'s default where it is None (chunk: CHUNK_DOT_PRECISION, scan: DOT_PRECISION)."""
    return dot_precision or (CHUNK_DOT_PRECISION if form == "chunk" else DOT_PRECISION)


def maxnreg(cap: int) -> dict[str, int]:
    """The launch option for a register cap (none for 0 or under the interpreter)."""
    return {"maxnreg": cap} if cap and not INTERPRET else {}


def fp_options(form: str) -> dict[str, bool]:
    """Launch options of a state-pass, output or decode kernel in ``form``. The chunk form's kernels compile without fp
    contraction (NO_FMA): a decode step redoes the training kernels' arithmetic for one row, so where LLVM contracts
    ``a * b + c`` into one fma must not depend on the kernel. With contraction it did: the decode row kernel fused
    ``beta v - (beta e^G k) E``, which the chain computes from the prep's stored, rounded ``beta v``, so Y rows could
    differ from training's (always at ieee). The training kernels' PTX is the same either way (they contract nothing).
    The scan form runs the same kernels on both sides and keeps contraction (its tf32x3 chain uses it)."""
    return NO_FMA if form == "chunk" else {}


@triton.jit
def dot(a, b, acc, PREC: tl.constexpr):
    """``a @ b (+ acc)`` in fp32 at precision PREC (DOT_PRECISIONS): an fp32 tl.dot with that input_precision, or for
    "bf16" the operands rounded to bf16 (tensor cores, fp32 accumulate)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)
