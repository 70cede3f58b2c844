"""Gated DeltaNet in Triton: the GPU path of the correctness profile (CPR semantics, invariant).

Same signatures as :mod:`megatron_iso.ops.gdn.reference`; not the reference's bits, but the same
*structure*, which is what makes training forward == chunked prefill (any split) == token-by-token
decode, bit for bit, for any batch composition and any subset of heads:

- **Output scan** (``_scan_kernel``): one program per (segment, value head, Dv block) holds its
  ``S[Dk, BV]`` block in registers and steps through the segment's tokens:
  ``S *= exp(g); u = beta (v - S^T k); S += k u^T; o = S^T q``. A segment is the part of a call that
  lies in one chunk (chunks aligned at position 0 of the sequence). Training scans every chunk from
  its entry state; decode scans one token from the slot's running state. Same kernel, same
  constexprs, the start state bitwise the same, so the same bits: the running state a decode step
  loads is the register state a training program would have carried (fp32 in memory is exact).
- **State pass** (``_prep_kernel`` + ``_chain_kernel``): chunk c's exit state from its entry state E,
  WY form. Per chunk, in parallel: ``G = cumsum(g)``, ``A_ti = beta_t e^{G_t-G_i} k_t.k_i`` (t > i),
  ``T^{-1}`` of ``T = I + A`` by 16-row blocks, ``U0 = T^{-1}(beta v)``, ``W = T^{-1}(beta e^G k)``,
  ``KD = e^{G_C-G} k``. Then one program per (sequence, head, Dv block) chains the chunks:
  ``u = U0 - W E; E' = e^{G_C} E + KD^T u`` (two fp32 ``tl.dot``; by default the prep's dots are ieee FMA
  chains and the chain's run on tensor cores as tf32x3, see "Dot precision" below).
  Decode, when a chunk closes, runs the same two kernels on the buffered chunk (the state cache's
  ``buf_*`` rows, read by the prep kernel exactly as it reads packed rows) from the stored entry
  state, and replaces the running state with the exit: the trainer's chunk state, bit for bit.
- conv1d + SiLU, l2norm and the gates: one element (conv, gates) or one row (l2norm) per program
  lane, fixed block sizes; nothing depends on the number of rows.

Every block size and warp count is chosen from (Dk, Dv, chunk) only, never from T or the batch. q, k,
v, g, beta are read in their own dtype (fp32, bf16, fp16) at their row stride and widened to fp32
in-kernel, which is exact, so a bf16 v gives the kernels the same fp32 values the host-side copy used to
(other dtypes, or inner dims that are not contiguous, are still copied to contiguous fp32 first). The
kernels are compiled per pointer dtype, alignment and stride divisibility; that changes how a load is
vectorised, not the fp32 operations on the values, and training and decode pass the same dtypes anyway
(the model's v is the conv output in the activation dtype on both sides); a GPU test holds bf16 strided
inputs bitwise equal to their fp32 copies. A decode step that does not close a chunk
launches the scan kernel only: the scan copies the tokens of a chunk the call leaves open into the state's
``buf_*`` rows (after the prep kernel of the same call has read any chunk the call closes from them).
Per-call planning (which rows form which segment/chunk) needs the sequence
boundaries on the host: one device->host copy per distinct (cu_seqlens, starts, slots), cached
across the layers of a forward (the model passes the same tensors to every layer).

K-blocked dots: every fp32 ieee ``tl.dot`` of the state pass runs over K in blocks of ``DOT_KB`` (16),
``acc = tl.dot(a_blk, b_blk, acc)`` over ascending blocks, operand blocks loaded from memory (T^{-1} and
beta e^G through a per-program scratch, E's row blocks from the state the chain stored last). One dot
over all of K held both operands' whole K extent per thread and spilled (sm_90a: prep 29 KB, chain
14 KB per thread); the blocked kernels do not spill. Bit-neutral BY CONSTRUCTION, not yet by a GPU run:
Triton 3.6 lowers an fp32 ieee dot to FMAs (``lib/Conversion/TritonGPUToLLVM/DotOpToLLVM/
FMADotUtility.cpp``, ``parametricConvertFMADot`` + ``GenericFMAVectorMultiplier``: per output element
``acc = c; for k in 0..K-1: acc = fma(a[k], b[k], acc)``), so chaining blocks through ``c`` makes the
same fmas in the same order. The previous ``egc * e + tl.dot(KD^T, u)`` was folded into the dot's ``c``
(TTIR), so the chain's accumulator starts at ``egc * e``; ``u = U0 - W E`` sums from zero, then subtracts.
The layout-dependent reductions (cumsum, row substitution) keep their layouts, and the pipelining depth
(``*_STAGES``) only moves loads. VERSION stayed "1": on the H200 a one-off test held the blocked
kernels bitwise equal to a frozen copy of the previous ones (2026-11-29, passed; the copy is deleted).

Triangular inverse (VERSION 2): ``T^{-1}`` of the unit lower triangular ``T = I + A`` by row blocks of
``IB`` (16) rows. A is stored to the program's scratch; the ``C / IB`` diagonal blocks are inverted together by
row substitution (``IB - 1`` dependent steps over a ``[C/IB, IB, IB]`` tile; row s of every block at once); then
block row i, in ascending order, is ``X_i. = -X_ii (sum_{j<i} A_ij X_j.)`` (K-blocked dots over j ascending,
from A's blocks still in the scratch). The 63-step substitution over ``[C, C]`` tiles that VERSION 1 ran (two
cross-warp reductions per step) is gone: 15 steps and 3 short block rows. The bits differ from VERSION 1;
training and the decode-side resync run this one kernel on the same chunk, so they agree.

Dot precision (VERSION 5: with a tensor-core prep precision, K K^T, U0 and W are whole-K dots from registers, not
K-blocked: H200 prep 6.3 -> 5.2 ms at tf32x3, 3.65 ms at tf32; the ieee prep keeps its K blocks): the prep and chain
kernels' dots take ``input_precision`` from ``GDNConfig.prep_precision`` and
``GDNConfig.chain_precision`` (each one of :data:`DOT_PRECISIONS`; the spec ``"P"`` sets both, ``"P/C"`` each).
Registered default since VERSION 3: "ieee/tf32x3", the prep's FMA chains above and the chain's two whole-K dots
per chunk on tensor cores (H200, 8 x 4096 training forward: chain 7.65 -> 2.85 ms, same error against fp64). With
"tf32x3" or "tf32" the dots run on tensor cores (MMA), and a K-blocked dot ``acc = tl.dot(a_blk, b_blk, acc)``
feeds each block's partial products through the MMA accumulator: the rounding inside an MMA differs from an fma
chain, so the bits differ from "ieee", but they are still a fixed function of (compiled kernel, operand tiles):
no atomics, no split-K across programs, the blocks in ascending order. The invariance needs no more than that: the
training forward and the decode-side resync run the same prep/chain kernel (same constexprs, PREC included)
on the same closed chunk (same fp32 values in the same tile positions), so training == rollout bitwise holds
for each precision, as long as both sides pass the same one. Accuracy against fp64 is measured on the GPU
(``tools/bench_gdn.py --dot-precision``), not derived.

Output forms (VERSIONS 6 to 8; ``GDNConfig.form``, per call ``form=`` (default "scan"), in the model ``profile.gdn_form``,
whose "auto" is the chunk form here):

- **scan**: outputs from the per-token scan above; decode is one scan step (fast decode, training bound by the
  scan's fp32 CUDA-core math).
- **chunk**: outputs as tiles, ``O = e^G (Q E) + P u`` with ``P[t, i] = e^{G_t - G_i} q_t.k_i`` (i <= t), one
  ``_chunk_out_kernel`` program per (chunk, value head, Dv block). The plan lists every chunk the call has tokens in,
  an open last chunk included (``nrows`` < C; its missing rows load as zeros); the chain stores each chunk's entry
  state (``ex``) and u (over U0, or bf16 tensors: "Intermediate storage") and skips an open chunk's exit;
  ``_buffer_kernel`` then copies the tokens (and their u and T^{-1} rows) of a chunk left open into the state cache,
  the chain its Y rows (below). Since VERSION 8 the chunk form's u comes from a block forward substitution
  ("Substitution" below), not from the WY form. A decode step (one token per sequence) computes its token's rows
  only: ``_decode_prep_kernel`` (row t of X_bb from the rows before it in ``state.buf_tinv``, by the prep's own fma
  chain; A's and P's row t; the token into the buffer), then ``_decode_row_kernel`` (Y, u and o rows, earlier Y and
  u rows from ``state.buf_y`` and ``state.buf_u``, the chunk's exit at its close). Rows < n of every tile do not
  depend on rows >= n, and a row's bits do not depend on the tile's row count (the MMA row probe,
  ``tools/probe_dot_rows.py``; on the H200 the GPU tests hold this for ieee, tf32, bf16, not for tf32x3, which this
  form refuses: :data:`CHUNK_FORM_PRECISIONS`). Since VERSION 7 nothing row-determining is a layout-dependent
  reduction (G by a ones-dot, the diagonal blocks of T^{-1} by fma chains; the row kernel picks u_t out of its tile
  by a sum whose other terms are -0.0, exact in any order). H200, bf16: training 8 x 4096 3.9 ms (scan form 14.1;
  2.7 since Session 10), prefill 1024 0.21 ms, decode batch 64 0.34 ms (scan form 0.09; chunk form 0.235 since
  Session 11, the T^{-1} row cache; 0.192 since Session 12; 0.159 ms of kernels against FLA's 0.093 since Session 13,
  with E read as bf16 from ``state.entry_bf16`` and both decode kernels capped at 168 registers; 0.145 against 0.094
  since Session 14: the unrolled diagonal chain, one-row operands and one address tile per k/v tile).
- "bf16" (in :data:`DOT_PRECISIONS`): operands rounded to bf16, fp32 accumulate, every dot of prep, chain and
  output; FLA's arithmetic class (H200, 1000 + 200 tokens vs fp64: 3.3e-4 max against FLA's 4.3e-4).

Substitution (VERSION 8, the chunk form): ``u = T^{-1} (beta v - beta e^G K E)`` is computed by block forward
substitution over IB-row blocks b in order, ``Y_b = beta v_b - (beta e^G k_b) E - sum_{j<b} A_bj u_j`` and
``u_b = X_bb Y_b`` (X_bb: T^{-1}'s diagonal block, the prep's fma chain), instead of ``U0 - W E``. The prep writes
``S`` (A's blocks below the diagonal, X_bb on it), ``beta v`` and ``beta e^G k``; the chain keeps u's blocks in
registers (a tuple). A decode step needs no U0, W or off-diagonal T^{-1} rows: its row t is one 16-row tile of each of
the chain's dots (the row probe), its Y rows are cached per block. The math is the WY form's; the rounding differs,
the same on both sides. A training call's prep still writes W and the whole T^{-1}, which the backward reads (it
differentiates the same function, so it is unchanged). H200, chunk:bf16 (PERFORMANCE.md "Session 18"): training
fwd+bwd 8.57 -> 8.67 ms (chain 0.62 -> 0.73, the prep 1.14 as before), decode batch 64 0.138 -> 0.124 ms.

Backward (training, Session 9): :class:`_RuleFunction` — the invariant forward, then the Triton chunk backward of
:mod:`megatron_iso.ops.gdn.gdn_triton_backward` (four kernels; deterministic, not invariant, as the policy allows; dots
at the forward chain's precision). It reads the chunk-form state pass of the call's chunks: the chunk form's forward
keeps its own (``keep_states``, ``rl.gdn_backward_states``), the scan form's backward runs the prep and chain kernels
once more with a chunk-form plan. H200, 8 x 4096, chunk:bf16: fwd+bwd 75.7 -> 11.3 ms (FLA 7.33, unchecked).

Intermediate storage (Session 10; :data:`MID_BF16`, ``GDNConfig.mid_dtype``): with bf16 chain dots, W and KD, and in the
chunk form u (its own tensor then, not over U0) and the entry states ``ex``, are stored as bf16. Every reader of them is
a bf16 dot, and a dot rounds an fp32 operand to that same bf16 (round to nearest even both ways), so the forward's bits
are those of fp32 storage (a GPU test compares the two); U0 (``u = U0 - W E`` is elementwise) and T^{-1} (the prep's
scratch) stay fp32, as does the scan form's ``ex`` (the scan starts from it). H200, 8 x 4096, chunk:bf16: forward
3.89 -> 2.73 ms, fwd+bwd 11.28 -> 9.64 ms.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_iso.contract.registry import OpImpl, register
from megatron_iso.ops.common.autograd import with_plain_backward
from megatron_iso.ops.common.ieee_math_triton import NO_FMA
from megatron_iso.ops.gdn import native
from megatron_iso.ops.gdn.reference import DEFAULT_CHUNK, L2NORM_EPS
from megatron_iso.ops.gdn.state_cache import OUTPUT_FORMS, GDNLayerState, check_value_buffer
from megatron_iso.ops.gdn.tensor_keyed_cache import TensorKeyedCache

# 8: the chunk form's u by block forward substitution (no U0, W or off-diagonal T^-1 blocks in its forward state pass
# outside training; decode without them); 7: G by an ieee dot with the lower-triangular ones and the diagonal blocks of
# T^-1 by explicit fma chains (no layout-dependent reduction decides a row), the chunk form's row-by-row decode step; 6:
# chunk-form outputs (opt-in), bf16 dots, chunk table with row counts; 5: the prep kernel in 4 warps (was 8), and a
# tensor-core prep precision (tf32x3, tf32) runs whole-K dots, not K-blocked ones; 4: scan of 32 Dv columns in 2 warps
# (was 4); 3: the chain's dots on tensor cores (tf32x3), the prep's stay ieee; 2: blocked triangular inverse in the prep
# kernel
VERSION = "8"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Dv block of the scan and chain programs (the Dv split is exact: columns of S are independent).
# Under the interpreter a small block, so tiny test shapes still cover several Dv blocks.
SCAN_BV = 4 if _INTERPRET else 32
# The chain's Dv block: 16 for its ieee path (K-blocked through memory), 32 for its tensor-core path (whole-K dots
# from registers; 2.85 vs 4.27 ms at BV 16 in the 8 x 4096 training forward, H200, docs/PERFORMANCE.md "Session 6").
CHAIN_BV = 4 if _INTERPRET else 16
CHAIN_BV_MMA = 4 if _INTERPRET else 32
# bf16 operands: Dv block 64 (H200, chunk form, 8 x 4096: chain 1.82 -> 1.25 ms; docs/PERFORMANCE.md "Session 8")
CHAIN_BV_BF16 = 4 if _INTERPRET else 64
MIN_DOT = 1 if _INTERPRET else 16  # tl.dot needs every dimension >= 16 on the GPU
# K block of the state-pass dots (module docstring, "K-blocked dots"); small under the interpreter so tiny shapes still
# run several blocks.
DOT_KB = 4 if _INTERPRET else 16
# Row block of the prep kernel's triangular inverse (module docstring, "Triangular inverse"): diagonal blocks by row
# substitution, all at once; the blocks below by K-blocked dots. Small under the interpreter so tiny chunks still
# have several blocks.
INV_BLOCK = 4 if _INTERPRET else 16
# The prep's 4 warps (VERSION 5; was 8): H200, prep kernel alone at 8 x 4096, ieee 5.35 -> 4.36 ms, tf32 3.6 -> 2.28 ms
# (docs/PERFORMANCE.md "Session 7", prep phases).
SCAN_WARPS, CHAIN_WARPS, PREP_WARPS = 2, 4, 4
# Software-pipelining depth of the K-block loops (bit-neutral: it only moves loads). Chosen with
# ``tools/bench_gdn.py --resources`` (sm_90a, Dk=Dv=128, chunk 64): the default 3 spills in both kernels.
PREP_STAGES, CHAIN_STAGES = 1, 2
# input_precision of the state pass's fp32 tl.dot (the scan has no dot). "ieee" lowers to FMA chains (no tensor
# cores); "tf32x3" (3 tf32 MMAs per product, ~fp32 accuracy) and "tf32" use tensor cores. Any of them keeps
# training == rollout bitwise: both sides run the same kernel on the same closed chunk (module docstring, "Dot
# precision"). A spec is one of DOT_PRECISIONS for both kernels, or "PREP/CHAIN". The default is the one the
# contract registers, "ieee/tf32x3": the prep kernel's dots stay FMA chains (tf32x3 did not pay there: 6.3 ms K-blocked,
# 5.2 ms whole-K since VERSION 5, vs 5.3 ms ieee), the chain's two whole-K dots per chunk run on tensor cores (2.85 vs
# 7.65 ms), with the same error against fp64 (6.0e-8 vs 6.1e-8 max at the bench's mismatch case). The others are
# opt-in per call.
DOT_PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16")  # bf16: operands rounded to bf16, fp32 accumulate (FLA's class)
DOT_PRECISION = "ieee/tf32x3"
# How a chunk's outputs are computed (GDNConfig.form; module docstring, "Output forms"): "scan", the per-token
# recurrence from the chunk's entry state (the registered default; decode is one scan step), or "chunk", output tiles
# O = e^G (Q E) + P u on tensor cores (training and prefill fast; decode recomputes its open chunk's tiles).
FORMS = OUTPUT_FORMS
FORM = "scan"
# The chunk form's decode step computes its token's rows through 16-row tiles, so it takes only the precisions whose
# row bits do not follow the tile's row count: on the H200 ieee, tf32 and bf16 held train == rollout at chunk 64,
# Dk = Dv = 128, tf32x3 did not (9e-9 apart; tests/gpu/test_gdn_triton.py, docs/PERFORMANCE.md "Session 8").
CHUNK_FORM_PRECISIONS = ("ieee", "tf32", "bf16")
CHUNK_DOT_PRECISION = "bf16"  # the chunk form's precision when a call names none
# Dv block of the chunk-form output kernel: all of Dv (H200, bf16, 8 x 4096: 1.57 ms at 64, 1.98 at 32, 1.35 at 128)
OUT_BV = 4 if _INTERPRET else 128
# With bf16 chain dots, the state pass's intermediates that only ever enter those dots (W, KD; chunk form: u and the
# entry states) are stored as bf16, the value the dot would round them to: the same bits, half the bytes
# ("Intermediate storage" in the module docstring). False: fp32 storage, for the test that holds the bits equal.
MID_BF16 = True
OUT_WARPS = 4
# Rows of A, P and of the output tiles in a chunk-form decode step: the 16 rows holding the token (tl.dot's
# minimum). Under the interpreter the whole chunk, rows at their true positions: numpy's matmul bits follow M and the
# row's position (the probe's CPU run), the H200's do not.
DECODE_ROWS = 0 if _INTERPRET else 16  # 0: the chunk
# The chunk-form decode row kernel's Dv block and warps, and the decode prep's warps. The Dv split is bit-neutral
# for every dot precision, ieee included, because every chunk-form kernel launches without fp contraction
# (_fp_options): with it, LLVM fused the row kernel's ``beta v - (beta e^G k) E`` into one fma at block 64 where the
# chain subtracts from the prep's rounded ``beta v``, and the ieee chunk-form tests failed (H200, Session 19); without
# it they pass at 64 (Session 20). Block 32 (4 programs per value head) was slower on the H200: row kernel 0.064 ->
# 0.098 ms at batch 64 (0.085 at a 128-register cap; Session 20).
DECODE_BV = 4 if _INTERPRET else 64
DECODE_WARPS, DECODE_PREP_WARPS = 4, 4
# A decode step's substitution sum (``sum_{j<b} A_tj u_j``) as one dot over the chunk with A's columns from the token's
# block on zero, where the chain runs one 16-column dot per earlier block: on the H200 a whole-K dot whose A is zero
# from column 16 nb on has the bits of nb block dots accumulated in ascending order at tf32 and bf16 (the probe's
# ``k_chain``, tools/probe_dot_rows.py, and the chunk-form GPU tests, Session 18). It reads u's earlier rows once (the
# output reads them too): row kernel 0.088 -> 0.078 ms at batch 64. Not at ieee, where the block dots are what the GPU
# tests passed (Session 19; Session 18 blamed the ieee failure on this sum, but it stayed without it: the cause was
# fp contraction in the row kernel); nor under the interpreter, whose numpy dot bits follow K.
DECODE_SUM_ONE_DOT = not _INTERPRET
# Register caps (ptxas .maxnreg) per kernel, 0: ptxas' own choice. A cap trades spills for programs per SM; it changes
# no arithmetic. Not passed under the interpreter. H200, decode batch 64, chunk:bf16: both decode kernels at 168 (3
# programs per SM instead of 2), device time 0.180 -> 0.158 ms (PERFORMANCE.md Sessions 12, 13); then the decode prep
# at 128 (4 per SM, no spills): prep 0.044 -> 0.041 ms, step 0.108 -> 0.106 (Session 20). The training kernels stay
# uncapped: the prep and the backward's local/output/WY kernels at 168 made the profiled fwd+bwd 10.44 -> 11.89 ms
# (the backward's output kernel 2.44 -> 3.58; Session 13).
PREP_MAXNREG, CHAIN_MAXNREG, OUT_MAXNREG, SCAN_MAXNREG = 0, 0, 0, 0
DECODE_MAXNREG, DECODE_PREP_MAXNREG = 168, 128
CHUNK_COLS = 5  # columns of a plan's chunk table (_prep_kernel's docstring)
CONV_BC = 256  # channels per conv program
ELEM_BLOCK = 1024  # elements per gates program


# -------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class GDNConfig:
    """Everything that fixes the kernels' instruction sequences: chosen from (Dk, Dv, chunk) only."""

    bk: int  # padded Dk
    bv_full: int  # padded Dv (prep kernel: the whole value dim)
    scan_bv: int
    chain_bv: int
    chunk: int
    kb: int  # K block of the prep/chain dots (divides chunk and bk; bit-neutral: module docstring)
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


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """``a @ b (+ acc)`` in fp32 at precision PREC (DOT_PRECISIONS): an fp32 tl.dot with that input_precision, or for
    "bf16" the operands rounded to bf16 (tensor cores, fp32 accumulate)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


# ------------------------------------------------------------------------------------- kernels
@triton.jit
def _scan_token_inputs(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, r, valid, scale, SQ, SK, SV, SG, SB, h, hk, DK, DV, ok, ov, mk, mv
):
    """Row r's k, q (scaled), v block, g, beta, widened to fp32; zeros where ``valid`` is false."""
    kt = tl.load(k_ptr + r * SK + hk * DK + ok, mask=mk & valid, other=0.0).to(tl.float32)
    qt = tl.load(q_ptr + r * SQ + hk * DK + ok, mask=mk & valid, other=0.0).to(tl.float32) * scale
    vt = tl.load(v_ptr + r * SV + h * DV + ov, mask=mv & valid, other=0.0).to(tl.float32)
    gt = tl.load(g_ptr + r * SG + h, mask=valid, other=0.0).to(tl.float32)
    bt = tl.load(b_ptr + r * SB + h, mask=valid, other=0.0).to(tl.float32)
    return kt, qt, vt, gt, bt


@triton.jit
def _scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, seg_ptr, run_ptr, ex_ptr, fin_ptr,
    bk_ptr, bv_ptr, bg_ptr, bb_ptr,
    scale, SQ, SK, SV, SG, SB, HK, HV, DK, DV, REP,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per-token recurrence over one segment for one (value head, Dv block).

    seg row (int32 x 8): first packed row, length, init kind (0 zeros / 1 run_ptr / 2 ex_ptr), init
    row, final row (-1: none), final kind (0 own state / 1 ex_ptr row), final source row, buffer row of
    the segment's first token (-1: none; else the segment leaves its chunk open and its tokens are copied
    into the state cache's ``buf_*`` rows from there on).

    q/k/v/g/beta are read in their own dtype (fp32, bf16 or fp16: exact to fp32) at row strides
    SQ..SB (inner dims contiguous). The buffer copy stores the values this program already loaded (v in
    buf_v's dtype, which holds it exactly): v's Dv block by every program, g and beta by the Dv block 0 program, k's
    key head by the Dv block 0 program of the first value head reading it, so every buffer element has one writer.
    """
    sid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // REP
    row0 = tl.load(seg_ptr + sid * 8).to(tl.int64)
    n = tl.load(seg_ptr + sid * 8 + 1)
    init_kind = tl.load(seg_ptr + sid * 8 + 2)
    init_row = tl.load(seg_ptr + sid * 8 + 3).to(tl.int64)
    fin_row = tl.load(seg_ptr + sid * 8 + 4).to(tl.int64)
    fin_kind = tl.load(seg_ptr + sid * 8 + 5)
    fin_src = tl.load(seg_ptr + sid * 8 + 6).to(tl.int64)
    brow0 = tl.load(seg_ptr + sid * 8 + 7).to(tl.int64)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    wbuf = brow0 >= 0
    wgb = wbuf & (vb == 0)
    wk = wgb & (h % REP == 0)
    st = (h * DK + ok[:, None]) * DV + ov[None, :]  # offset of S[h] block inside one [HV, DK, DV] state
    hsz = HV * DK * DV
    if init_kind == 1:
        s = tl.load(run_ptr + init_row * hsz + st, mask=m2, other=0.0)
    elif init_kind == 2:
        s = tl.load(ex_ptr + init_row * hsz + st, mask=m2, other=0.0)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    # Token t+1's inputs are loaded while token t is computed (one token ahead; masked past the segment's end):
    # the loads move, the arithmetic does not.
    kt, qt, vt, gt, bt = _scan_token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, row0, n > 0, scale, SQ, SK, SV, SG,
                                            SB, h, hk, DK, DV, ok, ov, mk, mv)  # fmt: skip
    for t in range(n):
        r = row0 + t
        kn, qn, vn, gn, bn = _scan_token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, r + 1, t + 1 < n, scale, SQ, SK,
                                                SV, SG, SB, h, hk, DK, DV, ok, ov, mk, mv)  # fmt: skip
        br = brow0 + t  # buffer row (only stored to when wbuf)
        tl.store(bv_ptr + (br * HV + h) * DV + ov, vt.to(bv_ptr.dtype.element_ty), mask=mv & wbuf)
        tl.store(bk_ptr + (br * HK + hk) * DK + ok, kt, mask=mk & wk)
        tl.store(bg_ptr + br * HV + h, gt, mask=wgb)
        tl.store(bb_ptr + br * HV + h, bt, mask=wgb)
        s = s * tl.exp(gt)
        u = bt * (vt - tl.sum(s * kt[:, None], axis=0))
        s = s + kt[:, None] * u[None, :]
        ot = tl.sum(s * qt[:, None], axis=0)
        tl.store(o_ptr + (r * HV + h) * DV + ov, ot, mask=mv)
        kt, qt, vt, gt, bt = kn, qn, vn, gn, bn
    if fin_row >= 0:
        if fin_kind == 1:  # the segment closed its chunk: the running state is the chunk's exit state
            s = tl.load(ex_ptr + fin_src * hsz + st, mask=m2, other=0.0)
        tl.store(fin_ptr + fin_row * hsz + st, s, mask=m2)


@triton.jit
def _buffered_or_packed(buf_ptrs, packed_ptrs, from_buf, mask):
    """A chunk tile of the prep kernel: where ``from_buf``, the state cache's buffer; elsewhere the call's packed rows;
    both widened exactly to fp32. Both sources hold the same values, so either gives the same chunk."""
    return tl.where(
        from_buf,
        tl.load(buf_ptrs, mask=from_buf & mask, other=0.0).to(tl.float32),
        tl.load(packed_ptrs, mask=(~from_buf) & mask, other=0.0).to(tl.float32),
    )


@triton.jit
def _k_tile(k_ptr, bk_ptr, tok, cols, row0, brow0, nbuf, nrows, SK, HK, DK, hk):
    """k of key head ``hk`` at chunk tokens ``tok`` and key columns ``cols``: tokens < ``nbuf`` from the state cache's
    buffer, the others from the packed rows, tokens >= ``nrows`` and columns >= DK as zeros (every kernel that reads a
    chunk's k reads it through here, so each sees the same tile)."""
    return _buffered_or_packed(
        (bk_ptr + (brow0 * HK + hk) * DK) + tok[:, None] * (HK * DK) + cols[None, :],
        (k_ptr + row0 * SK + hk * DK) + tok[:, None] * SK + cols[None, :],
        (tok < nbuf)[:, None],
        (cols < DK)[None, :] & (tok < nrows)[:, None],
    )


@triton.jit
def _v_tile(v_ptr, bvv_ptr, tok, cols, row0, brow0, nbuf, nrows, SV, HV, DV, h):
    """v of value head ``h`` at chunk tokens ``tok`` and value columns ``cols``, as :func:`_k_tile` reads k: tokens <
    ``nbuf`` from the state cache's buffer, the others from the packed rows, tokens >= ``nrows`` and columns >= DV as
    zeros."""
    return _buffered_or_packed(
        (bvv_ptr + (brow0 * HV + h) * DV) + tok[:, None] * (HV * DV) + cols[None, :],
        (v_ptr + row0 * SV + h * DV) + tok[:, None] * SV + cols[None, :],
        (tok < nbuf)[:, None],
        (cols < DV)[None, :] & (tok < nrows)[:, None],
    )


@triton.jit
def _beta_rows(b_ptr, bb_ptr, tok, row0, brow0, nbuf, nrows, SB, HV, h):
    """beta of value head ``h`` at chunk tokens ``tok``, as :func:`_v_tile` reads v: tokens < ``nbuf`` from the state
    cache's buffer, the others from the packed rows, tokens >= ``nrows`` as zeros."""
    return _buffered_or_packed(bb_ptr + (brow0 + tok) * HV + h, b_ptr + (row0 + tok) * SB + h, tok < nbuf, tok < nrows)


@triton.jit
def _decode_tile(buf_ptr, packed_ptr, rows, cols, t, RS, NCOLS):
    """A decode step's chunk tile (token t: buffered = t, present = t + 1): rows < t from the state cache's buffer
    (``buf_ptr``: row 0, rows RS apart), row t the token's packed row (``packed_ptr``), rows > t and columns >= NCOLS
    zeros. The values :func:`_k_tile` and the prep's v tile read there, from one tile of addresses instead of two."""
    cm = cols < NCOLS
    buf = tl.load(buf_ptr + rows[:, None] * RS + cols[None, :], mask=(rows < t)[:, None] & cm[None, :], other=0.0)
    buf = buf.to(tl.float32)
    tok = tl.load(packed_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    return tl.where((rows == t)[:, None], tok[None, :], buf)


@triton.jit
def _token_tile(row_ptr, cols, ncols, mine):
    """A decode step's ROWS-row dot operand holding one row, the token's (``mine``), zeros elsewhere: the values of a
    tile load masked to that row, from one row of addresses instead of ROWS."""
    x = tl.load(row_ptr + cols, mask=cols < ncols, other=0.0)
    return tl.where(mine[:, None], x[None, :], 0.0)


@triton.jit
def _output_p(q, k, g_rows, g_all, causal, PREC: tl.constexpr):
    """``P[t, i] = e^{G_t - G_i} (q_t . k_i)`` for i <= t (``causal``), 0 above: the intra-chunk weights of the
    chunk-form output rows (:func:`_output_rows`), in the training tile and in a decode step's prep."""
    qk = _dot(q, tl.trans(k), None, PREC)
    return tl.where(causal, qk * tl.exp(tl.where(causal, g_rows[:, None] - g_all[None, :], 0.0)), 0.0)


@triton.jit
def _output_rows(q, e, u, p, g_rows, PREC: tl.constexpr):
    """Chunk-form output rows ``e^{G_t} (q_t E) + P u`` (P: :func:`_output_p`): the one arithmetic of the training tile
    (``_chunk_out_kernel``) and of a decode step's rows (``_decode_row_kernel``, which computes ``q_t E`` early:
    :func:`_output_rows_from`)."""
    return _output_rows_from(_dot(q, e, None, PREC), u, p, g_rows, PREC)


@triton.jit
def _output_rows_from(qe, u, p, g_rows, PREC: tl.constexpr):
    """:func:`_output_rows` from its ``q E`` dot (``qe``), computed by the caller."""
    return _dot(p, u, qe * tl.exp(g_rows)[:, None], PREC)


@triton.jit
def _chunk_row(chunk_ptr, cid):
    """A plan's chunk row (_prep_kernel's docstring): packed row of token 0, buffered tokens, buffer row base,
    tokens present."""
    row = chunk_ptr + cid * 5
    return tl.load(row).to(tl.int64), tl.load(row + 1), tl.load(row + 2).to(tl.int64), tl.load(row + 3)


@triton.jit
def _chunk_gates(g_ptr, b_ptr, bg_ptr, bb_ptr, rows, brows, in_buf, present, SG, SB, HV, h, C: tl.constexpr):
    """beta and G = cumsum(g) of a chunk's rows (tokens in the buffer or packed, absent ones zero). G as an ieee dot
    with the lower-triangular ones (one fma chain per row, i ascending: a row's value depends on nothing but
    g_0..g_t, whatever the tile), not tl.cumsum, whose association follows the layout."""
    ot = tl.arange(0, C)
    gc = _buffered_or_packed(bg_ptr + brows * HV + h, g_ptr + rows * SG + h, in_buf, present)
    bc = _buffered_or_packed(bb_ptr + brows * HV + h, b_ptr + rows * SB + h, in_buf, present)
    o16 = tl.arange(0, 16)
    lower_eq = tl.where(ot[:, None] >= ot[None, :], 1.0, 0.0)
    g16 = tl.where(o16[None, :] == 0, gc[:, None], 0.0)
    cum = tl.sum(tl.where(o16[None, :] == 0, tl.dot(lower_eq, g16, input_precision="ieee"), 0.0), axis=1)
    return bc, cum


@triton.jit
def _kk_rows(k_ptr, bk_ptr, orr, kcf, krow, kd_ptr, base, dkd, row0, brow0, nbuf, nrows, SK, HK, DK, hk,
             C: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr, ROWS: tl.constexpr,
             STORE_KD: tl.constexpr):  # fmt: skip
    """Rows ``orr`` (ROWS of them) of K K^T: K-blocked over the key columns (ieee: KB at a time, ascending) or one
    whole-K dot of ``krow`` (k's rows orr) with ``kcf`` (tensor cores: the chunk's k tile; both loaded by the caller;
    with ROWS == C krow must be kcf itself: the interpreter's numpy computes ``x @ x.T`` of one array by another
    routine than of two, so a decode step under the interpreter must pass it as the prep does). STORE_KD (the prep,
    ROWS == C): also KD = e^{G_C-G} k (``dkd`` = e^{G_C-G}) into this (chunk, head)'s KD rows on the way, block by
    block."""
    ot = tl.arange(0, C)
    if PREC == "ieee":
        ob = tl.arange(0, KB)
        kk = tl.zeros([ROWS, C], dtype=tl.float32)
        for kb in range(BK // KB):
            okb = kb * KB + ob
            kcb = _k_tile(k_ptr, bk_ptr, ot, okb, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
            if ROWS == C:  # noqa: SIM108  (a constexpr branch: no second load at all)
                krb = kcb
            else:
                krb = _k_tile(k_ptr, bk_ptr, orr, okb, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
            kk = _dot(krb, tl.trans(kcb), kk, PREC)
            if STORE_KD:
                tl.store((kd_ptr + base * C * BK) + ot[:, None] * BK + okb[None, :],
                         (dkd[:, None] * kcb).to(kd_ptr.dtype.element_ty))  # fmt: skip
    else:
        kk = _dot(krow, tl.trans(kcf), None, PREC)
        if STORE_KD:
            tl.store((kd_ptr + base * C * BK) + ot[:, None] * BK + tl.arange(0, BK)[None, :],
                     (dkd[:, None] * kcf).to(kd_ptr.dtype.element_ty))  # fmt: skip
    return kk


@triton.jit
def _subst_operands(bcb, cumb, kb, vb):
    """``beta v`` and ``beta e^G k`` of some rows (``bcb``, ``cumb``: their beta and G; ``kb``, ``vb``: their k and v
    columns), the operands of :func:`_subst_y`: the one elementwise arithmetic of the prep's chunk rows and of a
    decode step's token row."""
    return bcb[:, None] * vb, (bcb * tl.exp(cumb))[:, None] * kb


@triton.jit
def _wy_rows(
    k_ptr, v_ptr, b_ptr, bk_ptr, bvv_ptr, bb_ptr, tr_ptr, bce_ptr, u0_ptr, w_ptr,
    kcf, bc, cum, row0, brow0, nbuf, nrows, SK, SV, SB, HK, HV, DK, DV, hk, h, base,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr, STORE_U0: tl.constexpr,
):  # fmt: skip
    """The chunk's U0 = T^{-1} (beta v) (STORE_U0: the scan form's chain reads it; the chunk form's computes its own
    R, :func:`_subst_y`) and W = T^{-1} (beta e^G k), T^{-1} read from ``tr_ptr`` (row r at ``tr_ptr + r * C``), into
    this (chunk, head)'s U0 and W. With a tensor-core PREC whole-K dots (``kcf``: the chunk's k tile); ieee: K-blocked
    over the chunk's tokens (KB at a time, ascending), v, k and beta e^G (``bce_ptr``, this program's scratch)
    reloaded per block."""
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BVF)
    if PREC != "ieee":
        ti = tl.load(tr_ptr + ot[:, None] * C + ot[None, :])
        if STORE_U0:
            vcf = _v_tile(v_ptr, bvv_ptr, ot, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
            u0 = _dot(ti, bc[:, None] * vcf, None, PREC)
            tl.store((u0_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], u0)
        w = _dot(ti, (bc * tl.exp(cum))[:, None] * kcf, None, PREC)
        tl.store((w_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :], w.to(w_ptr.dtype.element_ty))
    else:
        ob = tl.arange(0, KB)
        tl.store(bce_ptr + base * C + ot, bc * tl.exp(cum))
        tl.debug_barrier()  # other threads' scratch stores are read below
        # Two loops (not one): each holds one accumulator and one T^{-1} block, not two of each.
        if STORE_U0:
            u0 = tl.zeros([C, BVF], dtype=tl.float32)
            for tb in range(C // KB):
                otb = tb * KB + ob  # this block's tokens: the dot's K index
                ti = tl.load(tr_ptr + ot[:, None] * C + otb[None, :])
                vcb = _v_tile(v_ptr, bvv_ptr, otb, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
                bcb = _beta_rows(b_ptr, bb_ptr, otb, row0, brow0, nbuf, nrows, SB, HV, h)
                u0 = _dot(ti, bcb[:, None] * vcb, u0, PREC)
            tl.store((u0_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], u0)
        w = tl.zeros([C, BK], dtype=tl.float32)
        for tb in range(C // KB):
            otb = tb * KB + ob
            ti = tl.load(tr_ptr + ot[:, None] * C + otb[None, :])
            kcb = _k_tile(k_ptr, bk_ptr, otb, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
            bce = tl.load(bce_ptr + base * C + otb)
            w = _dot(ti, bce[:, None] * kcb, w, PREC)
        tl.store((w_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :], w.to(w_ptr.dtype.element_ty))


@triton.jit
def _prep_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, chunk_ptr,
    u0_ptr, w_ptr, kd_ptr, egc_ptr, gcum_ptr, tinv_ptr, bce_ptr, s_ptr, kp_ptr,
    SK, SV, SG, SB, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr, PREC: tl.constexpr,
    SUBST: tl.constexpr, WY: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): KD = e^{G_C-G} k, e^{G_C}, G (for the chunk-form output) and what the chain reads.
    Scan form (SUBST False): U0 and W of the WY form and T^{-1} (``tinv_ptr``: the program's scratch, T^{-1} at the
    end). Chunk form (SUBST): the operands of the chain's block forward substitution (module docstring,
    "Substitution"): ``S`` into ``s_ptr`` (in ``GDNConfig.mid_dtype``: A's blocks below the diagonal and ``X_bb``,
    T^{-1}'s diagonal blocks, on it), ``beta v`` over U0 (fp32) and ``beta e^G k`` into ``kp_ptr`` (mid dtype); with
    WY (a training call: the backward reads them) also W and the whole T^{-1}.

    chunk row (int32 x CHUNK_COLS): packed row of the chunk's token 0 (tokens >= ``buffered`` are packed rows
    ``row0 + t``), ``buffered`` (tokens 0..buffered-1 are in the state cache buffer), buffer row base, ``nrows``
    (tokens present: C for a closing chunk; rows from ``nrows`` on load as zeros, which leaves rows < nrows bitwise
    as they are in the full chunk, docs/GDN.md "Design sketch"), and a flag read by ``_buffer_kernel`` only.

    With an ieee PREC the dots run over K in blocks of KB with the accumulator carried in ascending k order (module
    docstring, "K-blocked dots"); their operand blocks are (re)loaded from memory: k and v from the inputs (the
    same fp32 values), T^{-1} and beta e^G from this program's scratch rows ``tinv_ptr``/``bce_ptr``.
    Packed k/v/g/beta are read in their own dtype at row strides SK..SB and converted exactly to fp32 (the
    buffer is fp32). PREC: the dots' ``input_precision`` (``GDNConfig.prep_precision``). A decode step computes
    one row of the same terms: ``_decode_prep_kernel``.
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // REP
    row0, nbuf, brow0, nrows = _chunk_row(chunk_ptr, cid)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    in_buf = ot < nbuf
    present = ot < nrows
    bc, cum = _chunk_gates(g_ptr, b_ptr, bg_ptr, bb_ptr, row0 + ot, brow0 + ot, in_buf, present, SG, SB, HV, h, C)
    gl = tl.sum(tl.where(ot == C - 1, cum, 0.0), axis=0)  # G_C
    lower = ot[:, None] > ot[None, :]
    base = cid * HV + h
    tl.store(gcum_ptr + base * C + ot, cum)
    dkd = tl.exp(gl - cum)
    if PREC == "ieee":
        kcf = tl.zeros([C, BK], dtype=tl.float32)  # not read: the ieee path reloads k in blocks
    else:  # tensor cores: whole-K dots (MMA operands are staged through shared memory, nothing to spill)
        kcf = _k_tile(k_ptr, bk_ptr, ot, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
    kk = _kk_rows(k_ptr, bk_ptr, ot, kcf, kcf, kd_ptr, base, dkd, row0, brow0, nbuf, nrows, SK, HK, DK, hk,
                  C, BK, KB, PREC, C, True)  # fmt: skip
    a = tl.where(lower, bc[:, None] * tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)) * kk, 0.0)
    # T^{-1} for T = I + A (unit lower triangular) by blocks of IB rows (module docstring, "Triangular inverse").
    # A goes to the scratch rows first: the diagonal blocks are read row by row, the blocks below by dots.
    tbase = tinv_ptr + base * C * C
    tile = ot[:, None] * C + ot[None, :]
    tl.store(tbase + tile, a)
    tl.debug_barrier()
    ob3 = tl.arange(0, C // IB)
    os3 = tl.arange(0, IB)
    # Every diagonal block at once, row s after row s-1, in the scratch over A's rows: X_s = e_s - sum_{r<s} A_sr X_r
    # as one explicit fma chain over r ascending per element (no reduction whose order follows a layout, so one row
    # can be recomputed alone with the same bits: _decode_prep_kernel). Row s of A is read before row s of X
    # replaces it.
    diag = (ob3[:, None] * IB) * C + ob3[:, None] * IB + os3[None, :]  # [NB, IB]: row 0 of each block
    tl.store(tbase + diag, tl.where(os3[None, :] == 0, 1.0, 0.0))  # A's row 0 of a block is 0 there: X_0 = e_0
    tl.debug_barrier()
    for srow in tl.static_range(1, IB):
        acc = tl.zeros([C // IB, IB], dtype=tl.float32)
        for r in tl.static_range(srow):
            a_sr = tl.load(tbase + (ob3 * IB + srow) * C + ob3 * IB + r)
            acc = tl.fma(a_sr[:, None], tl.load(tbase + diag + r * C), acc)
        x_s = tl.where(os3[None, :] == srow, 1.0, 0.0) - acc
        tl.debug_barrier()  # row srow of A is read by every thread before it is overwritten
        tl.store(tbase + diag + srow * C, x_s)
        tl.debug_barrier()
    if SUBST:  # the scratch holds S now: A below the diagonal blocks, X_bb on them, zeros above
        tl.store(s_ptr + base * C * C + tile, tl.load(tbase + tile).to(s_ptr.dtype.element_ty))
        ov = tl.arange(0, BVF)
        if PREC == "ieee":  # beta v and beta e^G k by row blocks (k is not in registers; G's rows as stored above)
            for rb0 in tl.static_range(0, C, IB):
                rb = rb0 + os3
                vblk = _v_tile(v_ptr, bvv_ptr, rb, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
                bcb = _beta_rows(b_ptr, bb_ptr, rb, row0, brow0, nbuf, nrows, SB, HV, h)
                kblk = _k_tile(k_ptr, bk_ptr, rb, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
                bv, kp = _subst_operands(bcb, tl.load(gcum_ptr + base * C + rb), kblk, vblk)
                tl.store((u0_ptr + base * C * BVF) + rb[:, None] * BVF + ov[None, :], bv)
                tl.store((kp_ptr + base * C * BK) + rb[:, None] * BK + ok[None, :], kp.to(kp_ptr.dtype.element_ty))
        else:  # whole tiles: k, beta and G are in registers
            vcf = _v_tile(v_ptr, bvv_ptr, ot, ov, row0, brow0, nbuf, nrows, SV, HV, DV, h)
            bv, kp = _subst_operands(bc, cum, kcf, vcf)
            tl.store((u0_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], bv)
            tl.store((kp_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :], kp.to(kp_ptr.dtype.element_ty))
    if WY:
        # Block rows below: X_i. = -X_ii (sum_{j<i} A_ij X_j.), K-blocked over j (ascending), from A's blocks still in
        # the scratch; columns at and right of the diagonal block keep X_ii and A's zeros.
        for ib in tl.static_range(1, C // IB):
            ri = ib * IB + os3
            rsum2 = tl.zeros([IB, C], dtype=tl.float32)
            for jb in tl.static_range(ib):
                rj = jb * IB + os3
                rsum2 = _dot(tl.load(tbase + ri[:, None] * C + rj[None, :]),
                             tl.load(tbase + rj[:, None] * C + ot[None, :]), rsum2, PREC)  # fmt: skip
            x_i = -_dot(tl.load(tbase + ri[:, None] * C + ri[None, :]), rsum2, None, PREC)
            tl.debug_barrier()  # row block ib of A is read by every thread before it is overwritten
            tl.store(tbase + ri[:, None] * C + ot[None, :], x_i, mask=(ot < ib * IB)[None, :])
            tl.debug_barrier()
        _wy_rows(
            k_ptr, v_ptr, b_ptr, bk_ptr, bvv_ptr, bb_ptr, tbase, bce_ptr, u0_ptr, w_ptr,
            kcf, bc, cum, row0, brow0, nbuf, nrows, SK, SV, SB, HK, HV, DK, DV, hk, h, base,
            C, BK, BVF, KB, PREC, not SUBST,
        )  # fmt: skip
    tl.store(egc_ptr + base, tl.exp(gl))


@triton.jit
def _decode_prep_rows(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, bt_ptr, chunk_ptr,
    kd_ptr, egc_ptr, gcum_ptr, p_ptr, a_ptr,
    scale, SQ, SK, SV, SG, SB, HK, HV, DK, DV, REP,
    sid, h,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr, PREC: tl.constexpr,
    OPREC: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Chunk form, a decode step at chunk position t = nrows - 1, for sequence ``sid`` and value head ``h``: the
    rows of ``_prep_kernel``'s terms that the row kernel's substitution and output read.

    - G for the whole chunk (the prep's dot); A's rows of t's ROWS-row block (K K^T rows by the prep's dots, A's
      elementwise formula) into this program's scratch ``a_ptr`` (ROWS x C): the row kernel reads row t's blocks.
    - Row t of X_bb (T^{-1}'s diagonal block holding t) by the prep's fma chain over the block's rows before t, read
      from the state cache (``bt_ptr``: buf_tinv, [slots, Hv, C, C]), and stored there; only the block's IB columns
      (the substitution reads no other).
    - Row t of the output's P (:func:`_output_p` at the output's precision OPREC, the chunk's k already in registers)
      into ``p_ptr`` (ROWS x C per program), so that the row kernel reads no k tile.
    - KD and e^{G_C} at the chunk's close.

    Every dot is the prep's with the same K extent and order; a row's bits depend on nothing but that row and the
    other operand (the MMA row probe), so row t is the training tile's. ROWS: ``DECODE_ROWS`` (the IB-row block on
    the GPU; the whole chunk under the interpreter, whose numpy dot bits follow the tile's row count and position).
    """
    hk = h // REP
    row0, nbuf, brow0, nrows = _chunk_row(chunk_ptr, sid)
    t = nrows - 1
    ib = t // IB
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    os3 = tl.arange(0, IB)
    r0 = (t // ROWS) * ROWS
    orr = r0 + tl.arange(0, ROWS)
    mine = orr == t
    # The token into the buffer first, while no tile is live (chunk row flag: the call leaves its chunk open). No
    # program reads buffer row t: every kernel of this step reads the token from the packed rows. (As a one-row tile,
    # tl.arange(0, 1), the prep took 0.085 -> 0.098 ms on the H200, Session 14: kept as the masked ROWS-row tile.)
    _buffer_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, orr,
                 mine & (tl.load(chunk_ptr + sid * 5 + 4) == 1), row0, brow0, SK, SV, SG, SB, HK, HV, DK, DV, REP, h,
                 BK, BVF)  # fmt: skip
    in_buf = ot < nbuf
    present = ot < nrows
    _, cum = _chunk_gates(g_ptr, b_ptr, bg_ptr, bb_ptr, row0 + ot, brow0 + ot, in_buf, present, SG, SB, HV, h, C)
    # q before the first store of G: a load after a store that may alias it stays after it, and loaded where P's dot
    # needs it (after A's store) it added a dependent memory round trip to the step
    q = _token_tile(q_ptr + (row0 + t) * SQ + hk * DK, ok, DK, mine)
    base = sid * HV + h
    tl.store(gcum_ptr + base * C + ot, cum)
    tbase = bt_ptr + ((brow0 // C) * HV + h) * C * C  # this slot's T^{-1} rows
    abase = a_ptr + base * ROWS * C  # A's rows orr
    kbuf, ktok = bk_ptr + (brow0 * HK + hk) * DK, k_ptr + (row0 + t) * SK + hk * DK
    kcf = _decode_tile(kbuf, ktok, ot, ok, t, HK * DK, DK)
    if ROWS == C:  # noqa: SIM108  (a constexpr branch: no second load at all)
        krow = kcf
    else:
        krow = _decode_tile(kbuf, ktok, orr, ok, t, HK * DK, DK)
    kk = _kk_rows(k_ptr, bk_ptr, orr, kcf, krow, kd_ptr, base, cum, row0, brow0, nbuf, nrows, SK, HK, DK, hk,
                  C, BK, KB, PREC, ROWS, False)  # fmt: skip
    tl.debug_barrier()  # G's rows stored by other threads are read below
    bcr = _beta_rows(b_ptr, bb_ptr, orr, row0, brow0, nbuf, nrows, SB, HV, h)
    cur = tl.load(gcum_ptr + base * C + orr)
    lower = orr[:, None] > ot[None, :]
    a = tl.where(lower, bcr[:, None] * tl.exp(tl.where(lower, cur[:, None] - cum[None, :], 0.0)) * kk, 0.0)
    tl.store(abase + tl.arange(0, ROWS)[:, None] * C + ot[None, :], a)
    p = _output_p(q.to(tl.float32) * scale, kcf, cur, cum, orr[:, None] >= ot[None, :], OPREC)
    tl.store(p_ptr + (base * ROWS + tl.arange(0, ROWS))[:, None] * C + ot[None, :], p, mask=mine[:, None])
    tl.debug_barrier()
    # Row t of X_bb: x_t = e_t - sum_{r<s} A_tr x_r over the block's rows r before t (s = t - ib IB), on the block's
    # columns. Unrolled over the IB - 1 rows a block can have before t, the rows r >= s masked and passed over by a
    # select: the prep's fmas, in its order, with every load issued at once (a run-time loop made one dependent round
    # trip per row).
    arow = abase + (t - r0) * C
    cols = ib * IB + os3
    acc = tl.zeros([IB], dtype=tl.float32)
    for r in tl.static_range(IB - 1):
        live = r < t - ib * IB
        x_r = tl.load(tbase + (ib * IB + r) * C + cols, mask=live & (os3 < IB), other=0.0)
        acc = tl.where(live, tl.fma(tl.load(arow + ib * IB + r, mask=live, other=0.0), x_r, acc), acc)
    tl.store(tbase + t * C + cols, tl.where(cols == t, 1.0, 0.0) - acc)
    if nrows == C:  # the chunk closes: KD and e^{G_C} for the decode row kernel's exit state
        gl = tl.sum(tl.where(ot == C - 1, cum, 0.0), axis=0)
        # k reloaded (one step in C closes a chunk), so that the k tile is dead after P's dot
        kcl = _decode_tile(kbuf, ktok, ot, ok, t, HK * DK, DK)
        tl.store((kd_ptr + base * C * BK) + ot[:, None] * BK + ok[None, :],
                 (tl.exp(gl - cum)[:, None] * kcl).to(kd_ptr.dtype.element_ty))  # fmt: skip
        tl.store(egc_ptr + base, tl.exp(gl))


@triton.jit
def _subst_y(bv, kp, e, acc, PREC: tl.constexpr):
    """Rows of ``Y = R - acc`` with ``R = beta v - (beta e^G k) E``, the block forward substitution's right-hand side
    (module docstring, "Substitution"): ``bv``, ``kp`` the rows' :func:`_subst_operands`, ``acc`` the sum of
    ``A_bj u_j`` over the earlier blocks j. The one arithmetic of the chain's block tiles and of a decode step's row."""
    return (bv - _dot(kp, e, None, PREC)) - acc


@triton.jit
def _chain_kernel(
    chain_ptr, entry_ptr, entry_bf16_ptr, u0_ptr, u_ptr, w_ptr, kd_ptr, egc_ptr, ex_ptr, chunk_ptr, s_ptr, kp_ptr,
    by_ptr, HV, DK, DV,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr,
    PREC: tl.constexpr, ENTRIES: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, Dv block): entry -> exit state over the sequence's chunks.

    chain row (int32 x 6): first chunk index, number of chunks, entry kind (0 zeros / 1 entry_ptr
    row), entry row (the slot), write back (1: store the last state into entry_ptr's row; with ENTRIES also its bf16
    rounding into entry_bf16_ptr's, ``GDNLayerState.entry_bf16``), last open (1: the last chunk does not close; its
    u is computed and stored, its exit state is not).

    Scan form (``ex_ptr`` row of chunk j: its exit state, which the scan starts from): the WY form per chunk,
    ``u = U0 - W E`` for all C rows (K = BK in blocks of KB, E's row blocks read back once each from the state this
    program stored last: the entry row or the previous chunk's exit row), then ``E' = dot(KD_b^T, u_b, E')`` over
    ascending row blocks b of u from ``e^{G_C} E`` (module docstring, "K-blocked dots"). Each output element is the fma
    chain of VERSION 1 (k ascending from 0 for W E, t ascending from ``e^{G_C} E`` for E'). With a tensor-core PREC
    (tf32x3, tf32) the chunk is two dots over the whole K, E and u straight from registers (the compiler stages MMA
    operands through shared memory). PREC: the dots' ``input_precision`` (``GDNConfig.chain_precision``).

    Chunk form (ENTRIES; ``ex_ptr`` row of chunk j: its entry state, which the output kernel reads): u by block
    forward substitution (module docstring, "Substitution"), for each IB-row block b in order
    ``Y_b = R_b - sum_{j<b} A_bj u_j`` (:func:`_subst_y`; the sum as dots accumulated over j ascending) and
    ``u_b = X_bb Y_b``, A's and X_bb's blocks from the prep's ``S`` (``s_ptr``), ``beta v`` from ``u0_ptr`` and
    ``beta e^G k`` from ``kp_ptr`` (the prep's), the earlier u blocks from registers
    (a tuple: through memory the chain took 1.46 ms instead of 0.70, PERFORMANCE.md "Session 18"); u into ``u_ptr``,
    and ``E' = e^{G_C} E + sum_b KD_b^T u_b`` (dots accumulated over b ascending). The Y rows of a chunk the call
    leaves open (chunk row flag) go to the state cache's ``by_ptr`` (buf_y) for the decode steps that follow.
    A decode step computes its token's row of each of these dots (``_decode_row_block``).
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    c0 = tl.load(chain_ptr + cid * 6).to(tl.int64)
    nc = tl.load(chain_ptr + cid * 6 + 1)
    ekind = tl.load(chain_ptr + cid * 6 + 2)
    erow = tl.load(chain_ptr + cid * 6 + 3).to(tl.int64)
    wb = tl.load(chain_ptr + cid * 6 + 4)
    last_open = tl.load(chain_ptr + cid * 6 + 5)
    ok = tl.arange(0, BK)
    ob = tl.arange(0, KB)
    oi = tl.arange(0, IB)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    st = (h * DK + ok[:, None]) * DV + ov[None, :]
    hsz = HV * DK * DV
    if ekind == 1:  # noqa: SIM108  (a run-time branch inside the kernel)
        e = tl.load(entry_ptr + erow * hsz + st, mask=m2, other=0.0)
    else:
        e = tl.zeros([BK, BV], dtype=tl.float32)
    oc = tl.arange(0, C)
    for j in range(nc):
        base = (c0 + j) * HV + h
        egc = tl.load(egc_ptr + base)
        first = j == 0
        closes = (j < nc - 1) | (last_open == 0)
        if ENTRIES:
            tl.store(ex_ptr + (c0 + j) * hsz + st, e.to(ex_ptr.dtype.element_ty), mask=m2)
            _, nbuf, brow0, nrows = _chunk_row(chunk_ptr, c0 + j)
            keep_y = tl.load(chunk_ptr + (c0 + j) * 5 + 4) == 1  # a chunk the call leaves open
            us = ()
            en = egc * e
            for b in tl.static_range(C // IB):
                rb = b * IB + oi
                srow = s_ptr + (base * C + rb[:, None]) * C
                acc = tl.zeros([IB, BV], dtype=tl.float32)
                for jb in tl.static_range(b):
                    acc = _dot(tl.load(srow + (jb * IB + oi)[None, :]), us[jb], acc, PREC)
                bv = tl.load(u0_ptr + (base * C + rb[:, None]) * BVF + ov[None, :], mask=mv[None, :], other=0.0)
                kp = tl.load(kp_ptr + (base * C + rb[:, None]) * BK + ok[None, :])
                y = _subst_y(bv, kp, e, acc, PREC)
                new_y = keep_y & (rb >= nbuf) & (rb < nrows)
                tl.store((by_ptr + (brow0 * HV + h) * DV) + rb[:, None] * (HV * DV) + ov[None, :],
                         y.to(by_ptr.dtype.element_ty), mask=new_y[:, None] & mv[None, :])  # fmt: skip
                ub = _dot(tl.load(srow + rb[None, :]), y, None, PREC)
                tl.store(u_ptr + (base * C + rb[:, None]) * BVF + ov[None, :], ub.to(u_ptr.dtype.element_ty),
                         mask=mv[None, :])  # fmt: skip
                us = us + (ub,)  # noqa: RUF005  (Triton 3.6 compiles tuple +, not a starred tuple)
                en = _dot(tl.trans(tl.load(kd_ptr + (base * C + rb[:, None]) * BK + ok[None, :])), ub, en, PREC)
            # an open chunk's exit is computed and dropped: a run-time branch around a dot crashed Triton 3.6's
            # prefetch pass at tf32 (chunk 16, Dk 32)
            e = tl.where(closes, en, e)
        elif PREC == "ieee":
            # d = W E for all C rows at once, K = BK in blocks of KB: each row block of E is loaded once per chunk.
            d = tl.zeros([C, BV], dtype=tl.float32)
            for kb in range(BK // KB):
                okb = kb * KB + ob
                wblk = tl.load(w_ptr + (base * C + oc[:, None]) * BK + okb[None, :])
                sb = (h * DK + okb[:, None]) * DV + ov[None, :]
                mb2 = (okb[:, None] < DK) & mv[None, :]
                # E's rows okb: masked lanes read 0.0, as the register state holds +0 there.
                e_in = tl.load(entry_ptr + erow * hsz + sb, mask=mb2 & first & (ekind == 1), other=0.0)
                e_ex = tl.load(ex_ptr + (c0 + tl.maximum(j - 1, 0)) * hsz + sb, mask=mb2 & (j > 0), other=0.0)
                e_blk = tl.where(first, e_in, e_ex)
                d = _dot(wblk, e_blk, d, PREC)
            # u = U0 - W E goes to memory (this program's columns, read by no one else), so the state update below
            # can read u back in row blocks.
            tile = (base * C + oc[:, None]) * BVF + ov[None, :]
            u = tl.load(u0_ptr + tile, mask=mv[None, :], other=0.0) - d
            tl.store(u_ptr + tile, u.to(u_ptr.dtype.element_ty), mask=mv[None, :])
            tl.debug_barrier()  # u's rows stored by other threads are read below
            if closes:
                acc = egc * e
                for mb in range(C // KB):
                    om = mb * KB + ob
                    ub = tl.load(u_ptr + (base * C + om[:, None]) * BVF + ov[None, :], mask=mv[None, :], other=0.0)
                    kd = tl.load(kd_ptr + (base * C + om[:, None]) * BK + ok[None, :])
                    acc = _dot(tl.trans(kd), ub, acc, PREC)
                e = acc
        else:  # tensor cores: two dots over the whole K per chunk, E and u from registers
            wfull = tl.load(w_ptr + (base * C + oc[:, None]) * BK + ok[None, :])
            tile = (base * C + oc[:, None]) * BVF + ov[None, :]
            u = tl.load(u0_ptr + tile, mask=mv[None, :], other=0.0) - _dot(wfull, e, None, PREC)
            kdfull = tl.load(kd_ptr + (base * C + oc[:, None]) * BK + ok[None, :])
            e = tl.where(closes, _dot(tl.trans(kdfull), u, egc * e, PREC), e)
        if not ENTRIES:
            tl.store(ex_ptr + (c0 + j) * hsz + st, e, mask=m2)
            if PREC == "ieee":
                tl.debug_barrier()  # the next chunk reads this state's row blocks stored by other threads
    if wb == 1:
        tl.store(entry_ptr + erow * hsz + st, e, mask=m2)
        if ENTRIES:
            tl.store(entry_bf16_ptr + erow * hsz + st, e.to(tl.bfloat16), mask=m2)


@triton.jit
def _chunk_out_kernel(
    q_ptr, k_ptr, bk_ptr, chunk_ptr, en_ptr, u_ptr, gcum_ptr, o_ptr,
    scale, SQ, SK, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Chunk-form outputs of one (chunk, value head, Dv block): ``O = e^G (Q E) + P u`` with
    ``P[t, i] = e^{G_t - G_i} (q_t . k_i)`` for i <= t (0 above), E the chunk's entry state (the chain's ``ex`` row),
    u the chain's (``u_ptr``), G the prep kernel's cumulative decay. Rows ``buffered..nrows-1`` are
    this call's tokens and are stored; a buffered row's q is not kept and loads as zero (its output was written by the
    call that brought it). Each output row is a function of its own q row, of the rows <= it of k, G and u, and of E:
    a decode step's tile (later rows zero) gives the training tile's bits (docs/GDN.md, "Design sketch").
    """
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // REP
    row0, nbuf, brow0, nrows = _chunk_row(chunk_ptr, cid)
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    present = ot < nrows
    new = present & (ot >= nbuf)
    base = cid * HV + h
    q = tl.load((q_ptr + row0 * SQ + hk * DK) + ot[:, None] * SQ + ok[None, :], mask=new[:, None] & mk[None, :],
                other=0.0)  # fmt: skip
    q = q.to(tl.float32) * scale
    k = _k_tile(k_ptr, bk_ptr, ot, ok, row0, brow0, nbuf, nrows, SK, HK, DK, hk)
    gc = tl.load(gcum_ptr + base * C + ot)
    e = tl.load(en_ptr + cid * HV * DK * DV + (h * DK + ok[:, None]) * DV + ov[None, :],
                mask=mk[:, None] & mv[None, :], other=0.0)  # fmt: skip
    u = tl.load((u_ptr + base * C * BVF) + ot[:, None] * BVF + ov[None, :], mask=mv[None, :], other=0.0)
    p = _output_p(q, k, gc, gc, ot[:, None] >= ot[None, :], PREC)
    o = _output_rows(q, e, u, p, gc, PREC)
    tl.store((o_ptr + (row0 * HV + h) * DV) + ot[:, None] * (HV * DV) + ov[None, :], o, mask=new[:, None] & mv[None, :])


@triton.jit
def _decode_row_block(
    q_ptr, k_ptr, v_ptr, b_ptr, chunk_ptr, chain_ptr, entry_ptr, entry_bf16_ptr, kd_ptr, egc_ptr, gcum_ptr, p_ptr,
    a_ptr, bt_ptr, bu_ptr, by_ptr, o_ptr,
    scale, SQ, SK, SV, SB, HV, DK, DV, REP,
    sid, h, vb,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IB: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr,
    SUM_ONE_DOT: tl.constexpr,
):  # fmt: skip
    """Chunk form, a call of one token per sequence (a decode step) at chunk position t: for sequence ``sid``, value
    head ``h`` and Dv block ``vb``, the token's rows of what training computes as tiles, from ``_decode_prep_kernel``'s
    A, X_bb and P rows and the state cache:

    - the substitution's row t (the chain's block b = t // IB): ``Y_t = R_t - sum_{j<b} A_tj u_j`` (:func:`_subst_y`,
      R's operands from the token's row (:func:`_subst_operands`), u's earlier blocks from ``buf_u``; with bf16 dots E
      from ``entry_bf16``), stored into ``buf_y``, then
      ``u_t = X_bb[t] Y_b`` with Y's earlier rows of the block from ``buf_y``, stored into ``buf_u``;
    - ``o_t = e^{G_t} (q_t E) + P_t u`` (the output kernel's), with u's earlier rows from ``buf_u``;
    - when t closes the chunk, ``E' = e^{G_C} E + sum_b KD_b^T u_b`` (the chain's) into ``entry``.

    Every dot has the training dot's K extent and order and, for the substitution's, its IB-row tile with row t in
    its place; only the other rows differ (zeros or other values), which moves no bit of row t on the H200 (the MMA
    row probe). Chunk and chain rows are the plan's (one each per sequence)."""
    hk = h // REP
    row0, _, brow0, nrows = _chunk_row(chunk_ptr, sid)
    ekind = tl.load(chain_ptr + sid * 6 + 2)
    erow = tl.load(chain_ptr + sid * 6 + 3).to(tl.int64)
    closes = tl.load(chain_ptr + sid * 6 + 5) == 0
    t = nrows - 1
    r0 = (t // ROWS) * ROWS
    orr = r0 + tl.arange(0, ROWS)
    mine = orr == t
    oi = tl.arange(0, IB)
    orb = (t // IB) * IB + oi  # the substitution block holding t
    mineb = orb == t
    ot = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    st = (h * DK + ok[:, None]) * DV + ov[None, :]
    hsz = HV * DK * DV
    base = sid * HV + h
    if PREC == "bf16":  # E as the dots round it, stored so at the chunk's close: the same bits from half the bytes
        e = tl.load(entry_bf16_ptr + erow * hsz + st, mask=m2 & (ekind == 1), other=0.0)
    else:
        e = tl.load(entry_ptr + erow * hsz + st, mask=m2 & (ekind == 1), other=0.0)
    bu_rows = (bu_ptr + (brow0 * HV + h) * DV) + ov[None, :]  # + row * (HV * DV): this slot's buf_u
    by_rows = (by_ptr + (brow0 * HV + h) * DV) + ov[None, :]
    u_prev = tl.load(bu_rows + ot[:, None] * (HV * DV), mask=(ot < t)[:, None] & mv[None, :], other=0.0).to(tl.float32)
    # Every operand this program does not write is loaded here, before its first store: the compiler keeps a load
    # after a store that may alias it, so loaded later each one added a dependent memory round trip to the step.
    # Y's rows of t's block before t (earlier steps' or the chain's), X_bb's row t and P's row t (the decode prep's),
    # G's rows of the output tile.
    y_prev = tl.load(by_rows + orb[:, None] * (HV * DV), mask=(orb < t)[:, None] & mv[None, :], other=0.0)
    xrow = _token_tile(bt_ptr + (((brow0 // C) * HV + h) * C + t) * C + (t // IB) * IB, oi, IB, mineb)
    p = _token_tile(p_ptr + (base * ROWS + t - r0) * C, ot, C, mine)
    g_out = tl.load(gcum_ptr + base * C + orr)
    q = _token_tile(q_ptr + (row0 + t) * SQ + hk * DK, ok, DK, mine).to(tl.float32) * scale
    qe = _dot(q, e, None, PREC)
    # Y_t: the earlier blocks' A_tj u_j (the chain's dots in its IB-row tiles), then R_t, in the chain's order
    arow = a_ptr + (base * ROWS + t - r0) * C
    if SUM_ONE_DOT:  # one dot over the chunk, A's columns from t's block on zero (DECODE_SUM_ONE_DOT)
        acc = _dot(tl.where((ot < (t // IB) * IB)[None, :], _token_tile(arow, ot, C, mineb), 0.0), u_prev, None, PREC)
    else:
        acc = tl.zeros([IB, BV], dtype=tl.float32)
        for jb in range(t // IB):
            uj = tl.load(bu_rows + (jb * IB + oi)[:, None] * (HV * DV), mask=mv[None, :], other=0.0)
            acc = _dot(_token_tile(arow + jb * IB, oi, IB, mineb), uj, acc, PREC)
    tok = row0 + t
    bv, kp = _subst_operands(
        tl.where(mineb, tl.load(b_ptr + tok * SB + h).to(tl.float32), 0.0),
        tl.load(gcum_ptr + base * C + orb),
        _token_tile(k_ptr + tok * SK + hk * DK, ok, DK, mineb).to(tl.float32),
        _token_tile(v_ptr + tok * SV + h * DV, ov, DV, mineb).to(tl.float32),
    )
    y = _subst_y(bv, kp, e, acc, PREC)
    tl.store(by_rows + orb[:, None] * (HV * DV), y.to(by_ptr.dtype.element_ty), mask=mineb[:, None] & mv[None, :])
    # u_t = X_bb[t] Y_b: Y's rows before t from buf_y, row t from registers (the value buf_y now holds, as a dot
    # rounds it); X_bb's row t as the decode prep stored it in buf_tinv
    yb = tl.where(mineb[:, None], y, y_prev.to(tl.float32))
    u = _dot(xrow, yb, None, PREC)
    tl.store(bu_rows + orb[:, None] * (HV * DV), u.to(bu_ptr.dtype.element_ty), mask=mineb[:, None] & mv[None, :])
    # u's rows as the output dot reads them: rows < t from buf_u (loaded above), row t from registers, exactly the
    # value buf_u now holds (as stored, then widened). The row is picked out of u's IB rows by a sum whose other
    # terms are -0.0, the identity of + (x + -0 == x for every x, +0 and -0 included), so no bit moves.
    u_t = tl.sum(tl.where(mineb[:, None], u, -0.0), axis=0).to(bu_ptr.dtype.element_ty).to(tl.float32)
    u_all = tl.where((ot == t)[:, None], u_t[None, :], u_prev)
    o = _output_rows_from(qe, u_all, p, g_out, PREC)
    tl.store(
        (o_ptr + (row0 * HV + h) * DV) + orr[:, None] * (HV * DV) + ov[None, :], o, mask=mine[:, None] & mv[None, :]
    )
    if closes:  # the chain's exit state of the chunk, from the u rows, block by block as the chain adds them
        # E again from memory (unchanged since the load above): the output's E tile is dead by now, so the exit
        # state's accumulator does not share the registers with it
        ec = tl.load(entry_ptr + erow * hsz + st, mask=m2 & (ekind == 1), other=0.0) * tl.load(egc_ptr + base)
        for b in tl.static_range(C // IB):
            rb = b * IB + oi
            ub = tl.load(bu_rows + rb[:, None] * (HV * DV), mask=(rb < t)[:, None] & mv[None, :], other=0.0)
            ub = tl.where((rb == t)[:, None], u_t[None, :], ub.to(tl.float32))
            kd = tl.load((kd_ptr + base * C * BK) + rb[:, None] * BK + ok[None, :])
            ec = _dot(tl.trans(kd), ub, ec, PREC)
        tl.store(entry_ptr + erow * hsz + st, ec, mask=m2)
        tl.store(entry_bf16_ptr + erow * hsz + st, ec.to(tl.bfloat16), mask=m2)
    else:  # a fresh sequence's open chunk keeps a zero entry state for the next step
        tl.store(entry_ptr + erow * hsz + st, tl.zeros([BK, BV], dtype=tl.float32), mask=m2 & (ekind == 0))
        tl.store(entry_bf16_ptr + erow * hsz + st, tl.zeros([BK, BV], dtype=tl.bfloat16), mask=m2 & (ekind == 0))


@triton.jit
def _decode_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, bt_ptr, chunk_ptr,
    kd_ptr, egc_ptr, gcum_ptr, p_ptr, a_ptr,
    scale, SQ, SK, SV, SG, SB, HK, HV, DK: tl.constexpr, DV: tl.constexpr, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, KB: tl.constexpr, IB: tl.constexpr, PREC: tl.constexpr,
    OPREC: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """:func:`_decode_prep_rows` per (sequence, value head): a decode step's first kernel (its second:
    ``_decode_row_kernel``)."""
    _decode_prep_rows(
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bvv_ptr, bg_ptr, bb_ptr, bt_ptr, chunk_ptr, kd_ptr, egc_ptr,
        gcum_ptr, p_ptr, a_ptr, scale, SQ, SK, SV, SG, SB, HK, HV, DK, DV, REP,
        tl.program_id(0).to(tl.int64), tl.program_id(1), C, BK, BVF, KB, IB, PREC, OPREC, ROWS,
    )  # fmt: skip


@triton.jit
def _decode_row_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, chunk_ptr, chain_ptr, entry_ptr, entry_bf16_ptr, kd_ptr, egc_ptr, gcum_ptr, p_ptr,
    a_ptr, bt_ptr, bu_ptr, by_ptr, o_ptr,
    scale, SQ, SK, SV, SB, HV, DK: tl.constexpr, DV: tl.constexpr, REP,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IB: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr,
    SUM_ONE_DOT: tl.constexpr,
):  # fmt: skip
    """:func:`_decode_row_block` per (sequence, value head, Dv block): a decode step's second kernel. DK and DV are
    constexprs, as in ``_decode_prep_kernel``: the column masks fold away where they equal the blocks (sm_90a, chunk:bf16:
    2368 -> 2184 SASS instructions, spills 32 -> 0 B; one compile per head size, which a model has one of)."""
    _decode_row_block(
        q_ptr, k_ptr, v_ptr, b_ptr, chunk_ptr, chain_ptr, entry_ptr, entry_bf16_ptr, kd_ptr, egc_ptr, gcum_ptr, p_ptr,
        a_ptr, bt_ptr, bu_ptr, by_ptr, o_ptr, scale, SQ, SK, SV, SB, HV, DK, DV, REP,
        tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), C, BK, BV, IB, ROWS, PREC, SUM_ONE_DOT,
    )  # fmt: skip


@triton.jit
def _buffer_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, tok, new, row0, brow0,
                 SK, SV, SG, SB, HK, HV, DK, DV, REP, h, BK: tl.constexpr, BVF: tl.constexpr):  # fmt: skip
    """Chunk tokens ``tok`` where ``new``: their packed k, v, g, beta as fp32 into the state cache's buffer rows
    (k by the first value head of each key head)."""
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BVF)
    rows = row0 + tok
    br = brow0 + tok
    hk = h // REP
    mv2 = new[:, None] & (ov < DV)[None, :]
    v = tl.load((v_ptr + row0 * SV + h * DV) + tok[:, None] * SV + ov[None, :], mask=mv2)
    tl.store(
        (bv_ptr + (brow0 * HV + h) * DV) + tok[:, None] * (HV * DV) + ov[None, :],
        v.to(bv_ptr.dtype.element_ty),
        mask=mv2,
    )
    tl.store(bg_ptr + br * HV + h, tl.load(g_ptr + rows * SG + h, mask=new).to(tl.float32), mask=new)
    tl.store(bb_ptr + br * HV + h, tl.load(b_ptr + rows * SB + h, mask=new).to(tl.float32), mask=new)
    mk2 = new[:, None] & (ok < DK)[None, :] & (h % REP == 0)
    kt = tl.load((k_ptr + row0 * SK + hk * DK) + tok[:, None] * SK + ok[None, :], mask=mk2)
    tl.store((bk_ptr + (brow0 * HK + hk) * DK) + tok[:, None] * (HK * DK) + ok[None, :], kt.to(tl.float32), mask=mk2)


@triton.jit
def _buffer_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, chunk_ptr, u_ptr, bu_ptr, tinv_ptr, bt_ptr,
    SK, SV, SG, SB, HK, HV, DK, DV, REP,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
):  # fmt: skip
    """Chunk form, a call that is not a decode step: the tokens of a chunk it leaves open (chunk row flag, column 4)
    into the state cache's ``buf_*`` rows, after every kernel that reads the buffer (a call that closes a chunk
    and opens the next reuses the slot's rows), with their u rows (the chain's ``u_ptr``) into ``buf_u`` and their
    T^{-1} rows (the prep's ``tinv_ptr``) into ``buf_tinv``, for the decode steps that follow (a decode step stores
    its own, in ``_decode_prep_kernel`` and ``_decode_row_kernel``)."""
    cid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row0, nbuf, brow0, nrows = _chunk_row(chunk_ptr, cid)
    wflag = tl.load(chunk_ptr + cid * 5 + 4)
    ot = tl.arange(0, C)
    ov = tl.arange(0, BVF)
    new = (ot >= nbuf) & (ot < nrows) & (wflag == 1)
    _buffer_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, ot, new, row0, brow0,
                 SK, SV, SG, SB, HK, HV, DK, DV, REP, h, BK, BVF)  # fmt: skip
    mu = new[:, None] & (ov < DV)[None, :]
    u = tl.load(u_ptr + ((cid * HV + h) * C + ot[:, None]) * BVF + ov[None, :], mask=mu)
    tl.store(
        (bu_ptr + (brow0 * HV + h) * DV) + ot[:, None] * (HV * DV) + ov[None, :], u.to(bu_ptr.dtype.element_ty), mask=mu
    )
    tile = ot[:, None] * C + ot[None, :]
    ti = tl.load(tinv_ptr + (cid * HV + h) * C * C + tile, mask=new[:, None])
    tl.store(bt_ptr + ((brow0 // C) * HV + h) * C * C + tile, ti, mask=new[:, None])


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, y_ptr, sid_ptr, cu_ptr, starts_ptr, slots_ptr, cs_ptr, CD,
    K: tl.constexpr, HAS_STATE: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """One packed row, BC channels: silu(sum_j w[:, j] x[t-K+1+j]); history from the conv state."""
    r = tl.program_id(0).to(tl.int64)
    oc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = oc < CD
    sid = tl.load(sid_ptr + r)
    a = tl.load(cu_ptr + sid).to(tl.int64)
    p = r - a  # position inside this call's rows of the sequence
    if HAS_STATE:
        warm = tl.load(starts_ptr + sid) > 0
        slot = tl.load(slots_ptr + sid).to(tl.int64)
    else:
        warm = False
        slot = 0
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = p - (K - 1) + j
        xr = tl.load(x_ptr + (r - (K - 1) + j) * CD + oc, mask=mc & (src >= 0), other=0.0).to(tl.float32)
        hs = tl.load(cs_ptr + (slot * CD + oc) * (K - 1) + (K - 1) + src, mask=mc & (src < 0) & warm, other=0.0)
        xv = tl.where(src >= 0, xr, hs.to(tl.float32))
        wj = tl.load(w_ptr + oc * K + j, mask=mc, other=0.0).to(tl.float32)
        acc = acc + wj * xv
    y = tl.math.div_rn(acc, 1.0 + tl.exp(-acc))
    tl.store(y_ptr + r * CD + oc, y.to(y_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _conv_state_kernel(
    x_ptr, cu_ptr, starts_ptr, slots_ptr, cs_ptr, CD,
    K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """conv_state[slot] = the sequence's last K-1 inputs (older ones from the state or zeros)."""
    i = tl.program_id(0)
    oc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = oc < CD
    a = tl.load(cu_ptr + i).to(tl.int64)
    n = tl.load(cu_ptr + i + 1).to(tl.int64) - a
    warm = tl.load(starts_ptr + i) > 0
    slot = tl.load(slots_ptr + i).to(tl.int64)
    jj = tl.arange(0, KP)
    mj = jj < K - 1
    idx = n - (K - 1) + jj  # row inside the call (< 0: from the old state, column K-1+idx)
    m = mc[:, None] & mj[None, :]
    xr = tl.load(x_ptr + (a + idx[None, :]) * CD + oc[:, None], mask=m & (idx[None, :] >= 0), other=0.0)
    old = tl.load(
        cs_ptr + (slot * CD + oc[:, None]) * (K - 1) + (K - 1) + idx[None, :],
        mask=m & (idx[None, :] < 0) & warm,
        other=0.0,
    )
    val = tl.where(idx[None, :] >= 0, xr.to(cs_ptr.dtype.element_ty), old)
    tl.store(cs_ptr + (slot * CD + oc[:, None]) * (K - 1) + jj[None, :], val, mask=m)


@triton.jit
def _l2norm_kernel(x_ptr, y_ptr, D, eps, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    x = tl.load(x_ptr + r * D + o, mask=o < D, other=0.0).to(tl.float32)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) + eps))
    tl.store(y_ptr + r * D + o, x * inv, mask=o < D)


@triton.jit
def _gates_kernel(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, N, H, BLOCK: tl.constexpr):
    """g in float64 (libdevice exp/log), rounded once: softplus(x) = max(x, 0) + log1p(exp(-|x|)) with
    log1p(y) = log(u) * y / (u - 1), u = 1 + y, accurate for tiny y; beta = 1 / (1 + exp(-b)) in fp32."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    h = i % H
    x = tl.load(a_ptr + i, mask=m, other=0.0).to(tl.float64) + tl.load(dt_ptr + h, mask=m, other=0.0).to(tl.float64)
    y = tl.exp(-tl.abs(x))
    uu = 1.0 + y
    d = uu - 1.0
    l1p = tl.where(d == 0.0, y, tl.log(uu) * (y / tl.where(d == 0.0, 1.0, d)))
    sp = tl.maximum(x, 0.0) + l1p
    al = tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float64)
    tl.store(g_ptr + i, (-(tl.exp(al) * sp)).to(tl.float32), mask=m)
    b = tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + i, tl.math.div_rn(1.0, 1.0 + tl.exp(-b)), mask=m)


# ------------------------------------------------------------------------------------ planning
@dataclass
class _Plan:
    n: int
    nseg: int
    nchunks: int
    seg: torch.Tensor  # [nseg, 8] int32 (device; columns: _scan_kernel's docstring; scan form)
    chunks: torch.Tensor  # [nchunks, CHUNK_COLS] int32 (_prep_kernel's docstring)
    chains: torch.Tensor  # [nchains, 6] int32 (_chain_kernel's docstring)
    nchains: int
    scratch: bool  # finals go to a scratch tensor (some sequence has several segments; scan form)
    buffers: bool  # some chunk's tokens go to the state cache's buffer (chunk form: _buffer_kernel runs)


# A call's plan, shared by the GDN layers of a forward (same layout tensors, chunk, state, device, slot count).
_PLAN_CACHE: TensorKeyedCache[_Plan] = TensorKeyedCache(4)


def _host_lists(cu: torch.Tensor, starts: torch.Tensor | None, slots: torch.Tensor | None):
    parts = [cu.reshape(-1).to(torch.int64)]
    for t in (starts, slots):
        if t is not None:
            parts.append(t.reshape(-1).to(device=cu.device, dtype=torch.int64))
    flat = torch.cat(parts).tolist()  # the one device->host copy of a call (cached across layers)
    n = cu.numel() - 1
    cu_l = flat[: n + 1]
    rest = flat[n + 1 :]
    st = [0] * n
    if starts is not None:
        st, rest = rest[:n], rest[n:]
    sl = rest[:n] if slots is not None else None
    return cu_l, st, sl


def _cached_plan(cu, starts, slots, chunk, has_state, dev, slot_count, form) -> _Plan:
    """:func:`_plan`, shared by the layers of a forward; the slot count is part of the key because the plan's bounds
    check depends on it."""
    extra = (chunk, has_state, dev, slot_count, form)
    return _PLAN_CACHE.get((cu, starts, slots), extra, lambda: _plan(cu, starts, slots, *extra))


def _plan(
    cu: torch.Tensor,
    starts: torch.Tensor | None,
    slots: torch.Tensor | None,
    chunk: int,
    has_state: bool,
    dev: torch.device,
    slot_count: int,
    form: str = FORM,
) -> _Plan:
    """Segments (with the buffer rows of a chunk left open), chunks and chains of a call, as int32 tables on ``dev``.
    Scan form: the chunk table holds the chunks the call closes (the state pass); chunk form: every chunk the call
    has tokens in, open ones included (each gets output tiles)."""
    cu_l, st, sl = _host_lists(cu, starts, slots)
    n = len(cu_l) - 1
    empty = [i for i in range(n) if cu_l[i + 1] <= cu_l[i]]
    if empty:
        raise ValueError(f"gated_delta_rule: sequences {empty} have no tokens in cu_seqlens={cu_l}; drop them")
    if has_state and sl is not None and any(not 0 <= s < slot_count for s in sl):
        raise ValueError(f"gated_delta_rule: slots {sl} outside the state cache's {slot_count} slots")
    if len(st) != n:
        raise ValueError(f"starts has {len(st)} entries for {n} sequences")
    if any(s < 0 for s in st):
        raise ValueError(f"starts must be >= 0, got {st}")
    if not has_state and any(st):
        raise ValueError(f"sequences starting at positions {st} need their GDN state (state=..., slots=...)")
    if has_state and (sl is None or len(sl) != n):
        raise ValueError("a GDN state cache needs one slot per sequence (slots=...)")
    segs, chunks, chains = [], [], []
    fin_rows = []
    multi = False
    for i in range(n):
        a, pos, end = cu_l[i], st[i], cu_l[i + 1]
        slot = sl[i] if has_state else 0
        first_chunk = len(chunks)
        prev_chunk = -1
        mine = []
        while a < end:
            o = pos % chunk
            b = min(end, a + chunk - o)
            closes = o + b - a == chunk
            # scan start: the running state (or zeros) for the call's first segment, else the exit state
            # of the chunk the previous segment closed
            init = (2, prev_chunk) if prev_chunk >= 0 else (1, slot) if pos > 0 else (0, 0)
            cidx = -1
            if closes or form == "chunk":
                cidx = len(chunks)
                chunks.append((a - o, o, slot * chunk, o + b - a, int(has_state and not closes)))
            # columns 0-6 and 10 go to the table (_scan_kernel's seg row); 7-9 are planning notes
            mine.append([a, b - a, init[0], init[1], -1, 0, 0, closes, cidx, o, -1])
            prev_chunk = cidx
            pos += b - a
            a = b
        if len(mine) > 1:
            multi = True
        nc = len(chunks) - first_chunk
        last_open = int(form == "chunk" and not mine[-1][7])
        if nc or (has_state and st[i] == 0):
            # write back: the open chunk's entry state for the next call (unchanged if no chunk closed and the
            # sequence did not start here)
            wb = has_state and (nc > last_open or st[i] == 0)
            chains.append((first_chunk, nc, 1 if st[i] > 0 else 0, slot, int(wb), last_open))
        if has_state:
            last = mine[-1]
            last[4] = i  # placeholder: becomes the slot (direct) or i (scratch) below
            last[5], last[6] = (1, last[8]) if last[7] else (0, 0)
            fin_rows.append(last)
            if not last[7]:  # the call leaves this chunk open: the scan copies its tokens into the buffer
                last[10] = slot * chunk + last[9]
        segs += mine
    for i, last in enumerate(fin_rows):
        last[4] = i if multi else sl[i]

    def tab(rows, cols):
        flat = [int(r[c]) for r in rows for c in cols]
        return torch.tensor(flat or [0] * len(cols), dtype=torch.int32).reshape(-1, len(cols)).to(dev)

    return _Plan(
        n=n,
        nseg=len(segs),
        nchunks=len(chunks),
        seg=tab(segs, (0, 1, 2, 3, 4, 5, 6, 10)),
        chunks=tab(chunks, range(CHUNK_COLS)),
        chains=tab(chains, range(6)),
        nchains=len(chains),
        scratch=multi,
        buffers=any(c[4] for c in chunks),
    )


# ---------------------------------------------------------------------------------- the rule
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # read in-kernel, widened exactly to fp32
# The state cache's tensors the kernels read and write in place with one fixed dtype (buf_v and buf_u may be narrower:
# _check_state_dtypes)
_STATE_DTYPES = {
    **dict.fromkeys(("buf_k", "buf_g", "buf_beta", "buf_tinv"), torch.float32),
    "entry_bf16": torch.bfloat16,
}


def _check_state_dtypes(state: GDNLayerState, v_dtype: torch.dtype, cfg: GDNConfig) -> None:
    """Each state tensor contiguous and in a dtype the kernels read and write without moving a bit: the fixed ones,
    ``buf_v`` in fp32 or v's dtype, ``buf_u`` in fp32 or the dtype the chunk form stores u in (``cfg.mid_dtype``)."""
    for name in (*_STATE_DTYPES, "buf_v", "buf_u", "buf_y"):
        buf, dtype = getattr(state, name), _STATE_DTYPES.get(name)
        if not buf.is_contiguous() or dtype not in (None, buf.dtype):
            raise ValueError(f"gated_delta_rule: state.{name} must be contiguous" + (f" {dtype}" if dtype else ""))
    check_value_buffer(state, v_dtype, "gated_delta_rule")
    for name in ("buf_u", "buf_y"):
        if getattr(state, name).dtype not in (torch.float32, cfg.mid_dtype):
            raise ValueError(
                f"gated_delta_rule: state.{name} is {getattr(state, name).dtype}, but dot_precision="
                f"{cfg.dot_precision!r} stores u and Y as {cfg.mid_dtype}; allocate the GDN state with "
                "u_dtype=chunk_u_dtype(dot_precision) or torch.float32"
            )


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


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` as a kernel reads it, and its row stride: as it is when its dtype widens exactly to fp32 and its
    dims after the first are contiguous (a view of the model's split q/k/v projection is), else an fp32
    contiguous copy. Saves the host-side cast/copy launch of a decode step."""
    inner = x.shape[1:]
    want, step = [], 1
    for n in reversed(inner):
        want.append(step)
        step *= n
    ok = all(n == 1 or st == w for n, st, w in zip(inner, x.stride()[1:], reversed(want), strict=True))
    if x.dtype not in _KERNEL_DTYPES or not ok:
        x = x.float().contiguous()
    return x, x.stride(0)


def _prep_outputs(n: int, hv: int, cfg: GDNConfig, dev: torch.device, wy: bool = True) -> tuple[torch.Tensor, ...]:
    """U0, W, KD, e^{G_C}, G of ``n`` chunks (W and KD in ``cfg.mid_dtype``, the rest fp32). Without ``wy`` (a decode
    step, which writes neither) U0 and W are KD itself, allocated once."""
    c = cfg.chunk
    kd = torch.empty(n, hv, c, cfg.bk, dtype=cfg.mid_dtype, device=dev)
    return (
        torch.empty(n, hv, c, cfg.bv_full, dtype=torch.float32, device=dev) if wy else kd,
        torch.empty_like(kd) if wy else kd,
        kd,
        torch.empty(n, hv, dtype=torch.float32, device=dev),
        torch.empty(n, hv, c, dtype=torch.float32, device=dev),
    )


def prep_chunks(
    rows: tuple[tuple[torch.Tensor, int], ...],
    buffers: tuple[torch.Tensor, ...],
    chunks: torch.Tensor,
    cfg: GDNConfig,
    wy: bool = True,
) -> tuple[torch.Tensor, ...]:
    """``_prep_kernel`` over the ``chunks`` table (int32 ``[n, CHUNK_COLS]``: the kernel's chunk rows): U0, W, KD,
    e^{G_C}, G, T^{-1}, S and ``beta e^G k`` of each chunk and value head (:func:`_prep_outputs`; T^{-1} fp32, the
    kernel's scratch). Scan form: U0, W and T^{-1} (S and ``beta e^G k`` are placeholders). Chunk form: S,
    ``beta e^G k``, and ``beta v`` in U0's tensor; with ``wy`` (a training call, whose backward reads them) W and
    T^{-1}, else T^{-1} holds S in fp32 and W is not written. ``rows``: k, v, g,
    beta as :func:`_rows` returns them (tensor, row stride); ``buffers``: the state cache's buf_k, buf_v, buf_g,
    buf_beta (any fp32 tensor when no token is buffered)."""
    (kf, sk), (vf, sv), (gf, sg), (bf, sb) = rows
    hk, dk = kf.shape[1:]
    hv, dv = vf.shape[1:]
    n, c, dev = chunks.shape[0], cfg.chunk, kf.device
    u0, w, kd, egc, gcum = terms = _prep_outputs(n, hv, cfg, dev)
    tinv = torch.empty(n, hv, c, c, dtype=torch.float32, device=dev)  # the kernel's scratch, T^{-1} at the end
    bce = torch.empty(n, hv, c, dtype=torch.float32, device=dev)  # scratch
    subst = cfg.form == "chunk"
    s = torch.empty(n, hv, c, c, dtype=cfg.mid_dtype, device=dev) if subst else tinv
    kp = torch.empty_like(kd) if subst else kd
    _prep_kernel[(n, hv)](
        kf, vf, gf, bf, *buffers, chunks, u0, w, kd, egc, gcum, tinv, bce, s, kp, sk, sv, sg, sb, hk, hv, dk, dv,
        hv // hk,
        C=c, BK=cfg.bk, BVF=cfg.bv_full, KB=cfg.kb, IB=cfg.inv_block, PREC=cfg.prep_precision, SUBST=subst,
        WY=wy or not subst, num_warps=PREP_WARPS, num_stages=PREP_STAGES, **_maxnreg(PREP_MAXNREG),
        **_fp_options(cfg.form),
    )  # fmt: skip
    return (*terms, tinv, s, kp)


def decode_rows(chunk: int) -> int:
    """The row count of a chunk-form decode step's tiles (``DECODE_ROWS``; its 0 means the whole chunk)."""
    return min(DECODE_ROWS or chunk, chunk)


def _maxnreg(cap: int) -> dict[str, int]:
    """The launch option for a register cap (none for 0 or under the interpreter)."""
    return {"maxnreg": cap} if cap and not _INTERPRET else {}


def _fp_options(form: str) -> dict[str, bool]:
    """Launch options of a state-pass, output or decode kernel in ``form``. The chunk form's kernels compile without fp
    contraction (NO_FMA): a decode step redoes the training kernels' arithmetic for one row, so where LLVM contracts
    ``a * b + c`` into one fma must not depend on the kernel. With contraction it did: the decode row kernel fused
    ``beta v - (beta e^G k) E`` (Session 19), which the chain computes from the prep's stored, rounded ``beta v``, so
    Y rows could differ from training's (always at ieee). The training kernels' PTX was the same either way (they
    contracted nothing). The scan form runs the same kernels on both sides and keeps contraction (its tf32x3 chain
    uses it)."""
    return NO_FMA if form == "chunk" else {}


def _decode_step(
    q: tuple[torch.Tensor, int],
    rows: tuple,
    buffers: tuple[torch.Tensor, ...],
    state: GDNLayerState,
    plan: _Plan,
    entries: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    cfg: GDNConfig,
    scale: float,
) -> None:
    """A chunk-form decode step (one token per sequence, ``plan``'s chunk and chain rows one per sequence) into
    ``out``: ``_decode_prep_kernel`` (A's rows of each token's ``DECODE_ROWS`` rows, the output's P row, KD and
    e^{G_C} where it closes its chunk, G (:func:`_prep_outputs`); the token's X_bb row into ``state.buf_tinv``), then
    ``_decode_row_kernel`` (Y and u rows into ``state.buf_y`` and ``state.buf_u``, o, the exit state at a close).
    ``q``, ``rows``: as :func:`_rows` returns them."""
    qf, sq = q
    (kf, sk), (vf, sv), (gf, sg), (bf, sb) = rows
    hk, dk = kf.shape[1:]
    hv, dv = vf.shape[1:]
    n, c, dev = plan.n, cfg.chunk, kf.device
    nrows = decode_rows(c)
    _, _, kd, egc, gcum = _prep_outputs(n, hv, cfg, dev, wy=False)
    p = torch.empty(n, hv, nrows, c, dtype=torch.float32, device=dev)  # the output's P rows
    a = torch.empty_like(p)  # A's rows, read by the row kernel
    sizes = (hv, dk, dv, hv // hk)
    _decode_prep_kernel[(n, hv)](
        qf, kf, vf, gf, bf, *buffers, state.buf_tinv, plan.chunks, kd, egc, gcum, p, a, scale, sq, sk, sv, sg, sb, hk,
        *sizes, C=c, BK=cfg.bk, BVF=cfg.bv_full, KB=cfg.kb, IB=cfg.inv_block, PREC=cfg.prep_precision,
        OPREC=cfg.chain_precision, ROWS=nrows, num_warps=DECODE_PREP_WARPS, num_stages=PREP_STAGES,
        **_maxnreg(DECODE_PREP_MAXNREG), **_fp_options(cfg.form),
    )  # fmt: skip
    _decode_row_kernel[(n, hv, triton.cdiv(dv, cfg.decode_bv))](
        qf, kf, vf, bf, plan.chunks, plan.chains, *entries, kd, egc, gcum, p, a, state.buf_tinv, state.buf_u,
        state.buf_y, out, scale, sq, sk, sv, sb, *sizes, C=c, BK=cfg.bk, BV=cfg.decode_bv, IB=cfg.inv_block,
        ROWS=nrows, PREC=cfg.chain_precision, SUM_ONE_DOT=DECODE_SUM_ONE_DOT and cfg.chain_precision != "ieee",
        num_warps=DECODE_WARPS,
        **_maxnreg(DECODE_MAXNREG), **_fp_options(cfg.form),
    )  # fmt: skip


def _state_rows(nchunks: int, hv: int, dk: int, dv: int, cfg: GDNConfig, dev: torch.device) -> torch.Tensor:
    """The chain's ``ex`` rows (one state per chunk): fp32 exit states (scan form, the scan starts from them) or
    entry states in ``cfg.mid_dtype`` (chunk form, read by dots only)."""
    dtype = cfg.mid_dtype if cfg.form == "chunk" else torch.float32
    return torch.empty(max(nchunks, 1), hv, dk, dv, dtype=dtype, device=dev)


def _no_state(ex: torch.Tensor) -> torch.Tensor:
    """What a call without a state cache passes for its fp32 buffers and entry/running rows (never read or written:
    no buffered tokens, no buffer rows): fp32 like the real ones, so training and decode launch the same compiled
    kernels. ``ex`` itself when it is fp32 (the scan form's)."""
    return ex if ex.dtype == torch.float32 else torch.empty(1, dtype=torch.float32, device=ex.device)


def _no_entries(ex: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's ``entry`` / ``entry_bf16`` pointers of a call without a state cache (never read or written: no
    chain writes back): fp32 and bf16 like the cache's, for the same compiled kernels."""
    return _no_state(ex), torch.empty(1, dtype=torch.bfloat16, device=ex.device)


def _state_pass(
    plan: _Plan,
    prep_rows: tuple,
    buffers: tuple,
    entries: tuple[torch.Tensor, torch.Tensor],
    ex: torch.Tensor,
    cfg: GDNConfig,
    buf_y: torch.Tensor | None = None,
    wy: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Prep and chain kernels over a plan's chunks and chains: u (chunk form; the scan form: U0), W, KD, e^{G_C}, G
    and T^{-1} per chunk (:func:`prep_chunks`, ``wy`` as there); ``ex`` (:func:`_state_rows`) gets each chunk's exit
    (scan form) or entry state (chunk form). The chunk form's u is a tensor of its own in ``cfg.mid_dtype``, or over
    U0 when that is fp32. ``entries``: the state cache's ``entry`` and ``entry_bf16`` (without a cache,
    :func:`_no_entries`); ``buf_y``: the cache's (chunk form: the chain stores the Y rows of a chunk left open)."""
    # no chunk: a chain may still store its (zero) entry state into the cache
    terms = prep_chunks(prep_rows, buffers, plan.chunks, cfg, wy) if plan.nchunks else (ex,) * 8
    u0, w, kd, egc, gcum, tinv, s, kp = terms
    own_u = plan.nchunks and cfg.form == "chunk" and cfg.mid_bf16
    u = torch.empty(u0.shape, dtype=cfg.mid_dtype, device=u0.device) if own_u else u0
    hv, dk, dv = ex.shape[1:]
    if plan.nchains:
        _chain_kernel[(plan.nchains, hv, triton.cdiv(dv, cfg.chain_bv))](
            plan.chains, *entries, u0, u, w, kd, egc, ex, plan.chunks, s, kp, u if buf_y is None else buf_y, hv, dk, dv,
            C=cfg.chunk, BK=cfg.bk, BVF=cfg.bv_full, BV=cfg.chain_bv, KB=cfg.kb, IB=cfg.inv_block,
            PREC=cfg.chain_precision, ENTRIES=cfg.form == "chunk", num_warps=CHAIN_WARPS, num_stages=CHAIN_STAGES,
            **_maxnreg(CHAIN_MAXNREG), **_fp_options(cfg.form),
        )  # fmt: skip
    return u, w, kd, egc, gcum, tinv


def _rule_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None,
    chunk: int,
    state: GDNLayerState | None,
    slots: torch.Tensor | None,
    starts: torch.Tensor | None,
    dot_precision: str | None,
    form: str | None,
    kept: dict | None = None,
) -> torch.Tensor:
    """The forward (module docstring). ``kept``: a training call's dict for the backward: ``cfg``, ``scale`` and,
    for the chunk form, ``plan`` and ``states`` (the chunk-form state pass, :mod:`.gdn_triton_backward`)."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(
            f"gated_delta_rule: shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} g{tuple(g.shape)} "
            f"beta{tuple(beta.shape)} do not fit q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv]"
        )
    if hv % hk:
        raise ValueError(f"gated_delta_rule: value heads {hv} must be a multiple of key heads {hk}")
    if state is not None and state.chunk != chunk:
        raise ValueError(f"gated_delta_rule: state cache chunk {state.chunk} != chunk {chunk}")
    form = form or FORM
    dot_precision = form_dot_precision(form, dot_precision)
    cfg = config_for(dk, dv, chunk, dot_precision, form)
    scale = dk**-0.5 if scale is None else float(scale)
    dev = q.device
    slot_count = 0 if state is None else state.entry.shape[0]
    plan = _cached_plan(cu_seqlens, starts, slots, chunk, state is not None, dev, slot_count, cfg.form)
    if kept is not None:
        kept.update(cfg=cfg, scale=scale)
    (qf, sq), (kf, sk), (vf, sv), (gf, sg), (bf, sb) = (_rows(x) for x in (q, k, v, g, beta))
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=dev)
    if t == 0:
        return out
    rep = hv // hk
    ex = _state_rows(plan.nchunks, hv, dk, dv, cfg, dev)
    chunk_form = cfg.form == "chunk"
    if state is not None:
        bk, bvv, bg, bb = state.buf_k, state.buf_v, state.buf_g, state.buf_beta
        _check_state_dtypes(state, v.dtype, cfg)
        needs = (
            {
                "buf_u": (chunk, hv, dv),
                "buf_y": (chunk, hv, dv),
                "buf_tinv": (hv, chunk, chunk),
                "entry_bf16": (hv, dk, dv),
            }
            if chunk_form
            else {"running": (hv, dk, dv)}
        )
        for name, shape in needs.items():
            if tuple(getattr(state, name).shape[1:]) != shape:
                raise ValueError(
                    f"gated_delta_rule: form={cfg.form!r} reads state.{name}, but this state cache was allocated for "
                    f"the other form (GDNLayerState.allocate(..., form={cfg.form!r}); profile.gdn_form)"
                )
        entries, running = (state.entry, state.entry_bf16), state.running
    else:
        bk = bvv = bg = bb = running = _no_state(ex)
        entries = _no_entries(ex)
    prep_rows = ((kf, sk), (vf, sv), (gf, sg), (bf, sb))
    if chunk_form and state is not None and plan.n == t:  # one token per sequence: a decode step, row by row
        _decode_step((qf, sq), prep_rows, (bk, bvv, bg, bb), state, plan, entries, out, cfg, scale)
        return out
    buf_y = state.buf_y if state is not None and chunk_form else None
    terms = _state_pass(plan, prep_rows, (bk, bvv, bg, bb), entries, ex, cfg, buf_y, wy=kept is not None)
    u, gcum = terms[0], terms[4]
    if kept is not None and chunk_form:
        kept.update(plan=plan, states=(*terms, ex))
    if chunk_form:  # output tiles per chunk from its entry state (ex) and u; then the buffer
        _chunk_out_kernel[(plan.nchunks, hv, triton.cdiv(dv, cfg.out_bv))](
            qf, kf, bk, plan.chunks, ex, u, gcum, out, scale, sq, sk, hk, hv, dk, dv, rep,
            C=chunk, BK=cfg.bk, BVF=cfg.bv_full, BV=cfg.out_bv, PREC=cfg.chain_precision, num_warps=OUT_WARPS,
            **_maxnreg(OUT_MAXNREG), **_fp_options(cfg.form),
        )  # fmt: skip
        if plan.buffers:
            _buffer_kernel[(plan.nchunks, hv)](
                kf, vf, gf, bf, bk, bvv, bg, bb, plan.chunks, u, state.buf_u, terms[5], state.buf_tinv, sk, sv, sg, sb,
                hk, hv, dk, dv, rep, C=chunk, BK=cfg.bk, BVF=cfg.bv_full,
            )  # fmt: skip
        return out
    fin = running
    if state is not None and plan.scratch:
        fin = torch.empty(plan.n, hv, dk, dv, dtype=torch.float32, device=dev)
    # The scan also writes the tokens of chunks this call leaves open into the state's buffer (seg column 7).
    # Ordering: it runs after the prep kernel, so a chunk closed from the buffer has been read before the
    # buffer rows are reused (a sequence whose call closes a chunk restarts its buffer at row 0).
    _scan_kernel[(plan.nseg, hv, triton.cdiv(dv, cfg.scan_bv))](
        qf, kf, vf, gf, bf, out, plan.seg, running, ex, fin, bk, bvv, bg, bb, scale, sq, sk, sv, sg, sb,
        hk, hv, dk, dv, rep, BK=cfg.bk, BV=cfg.scan_bv, num_warps=SCAN_WARPS, **_maxnreg(SCAN_MAXNREG),
    )  # fmt: skip
    if state is not None and plan.scratch:
        running.index_copy_(0, slots.to(device=dev, dtype=torch.int64), fin)
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    state: GDNLayerState | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    dot_precision: str | None = None,
    form: str | None = None,
    keep_states: bool = True,
) -> torch.Tensor:
    """CPR gated delta rule over packed sequences (fp32 ``[T, Hv, Dv]``); see the module docstring.

    ``dot_precision``: ``input_precision`` of the state pass's dots, one of :data:`DOT_PRECISIONS` for both
    kernels or ``"PREP/CHAIN"`` (None: :data:`DOT_PRECISION`, the registered one; for the chunk form
    :data:`CHUNK_DOT_PRECISION`, and only :data:`CHUNK_FORM_PRECISIONS`). Training and rollout must pass
    the same value: it fixes the state pass's bits (the state cache does not record it).
    ``form``: how outputs are computed, one of :data:`FORMS` (None: :data:`FORM`, the registered one); the same
    rule holds: training and rollout pass the same form (a state cache filled under one is meaningless to the other).
    ``keep_states``: with a gradient, a chunk-form forward keeps its state pass for the backward (False: the backward
    recomputes it; the same kernels on the same inputs, so the same gradient bits; ``ops.gdn.BACKWARD_STATES``)."""
    fwd = functools.partial(
        _rule_forward, cu_seqlens=cu_seqlens, scale=scale, chunk=chunk, state=state, slots=slots, starts=starts,
        dot_precision=dot_precision, form=form,
    )  # fmt: skip
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta))
    if not needs_grad:
        return fwd(q, k, v, g, beta)
    if state is not None:
        raise NotImplementedError(
            "gated_delta_rule (triton): gradients through a call with a GDN state cache (rollout) are not supported"
        )
    return _RuleFunction.apply(q, k, v, g, beta, fwd, cu_seqlens, keep_states)


class _RuleFunction(torch.autograd.Function):
    """The invariant forward of a training call; backward: the Triton chunk backward (:mod:`.gdn_triton_backward`),
    from the chunk-form state pass a chunk-form forward kept, or recomputed after a scan-form one (same chunks, same
    algebra: the backward only has to be deterministic)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, fwd, cu_seqlens, keep_states):  # type: ignore[override]
        kept: dict = {}
        out = fwd(q, k, v, g, beta, kept=kept)
        ctx.cfg, ctx.scale, ctx.plan, ctx.cu = kept.get("cfg"), kept.get("scale"), kept.get("plan"), cu_seqlens
        ctx.save_for_backward(q, k, v, g, beta, *(kept.get("states", ()) if keep_states else ()))
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        from megatron_iso.ops.gdn.gdn_triton_backward import rule_backward  # it imports this module's jit helpers

        q, k, v, g, beta, *states = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        if q.shape[0] == 0:
            return (*(torch.zeros_like(x) for x in inputs), None, None, None)
        hk, dk = k.shape[1:]
        hv, dv = v.shape[1:]
        rows = tuple(_rows(x) for x in inputs)
        cfg, plan = ctx.cfg, ctx.plan
        if not states:  # scan-form forward (or states not kept): the chunk-form state pass of the same chunks
            cfg = dataclasses.replace(cfg, form="chunk")
            plan = _cached_plan(ctx.cu, None, None, cfg.chunk, False, q.device, 0, "chunk")
            ex = _state_rows(plan.nchunks, hv, dk, dv, cfg, q.device)
            unused = _no_state(ex)
            states = (*_state_pass(plan, rows[1:], (unused,) * 4, _no_entries(ex), ex, cfg), ex)
        grads = rule_backward(d_out, rows, (hk, dk, hv, dv), plan, tuple(states), cfg, ctx.scale)
        return (*(d.to(x.dtype) for d, x in zip(grads, inputs, strict=True)), None, None, None)


# ------------------------------------------------------------------------------ conv and norms
def _conv_forward(x, weight, cu_seqlens, conv_state, slots, starts):
    t, cd = x.shape
    kw = weight.shape[-1]
    if weight.shape != (cd, kw):
        raise ValueError(f"causal_conv1d: weight shape {tuple(weight.shape)} != (channels={cd}, kernel)")
    if conv_state is not None:
        if slots is None or slots.numel() != cu_seqlens.numel() - 1:
            raise ValueError("a conv state needs one slot per sequence (slots=...)")
        if conv_state.shape[1:] != (cd, kw - 1) or not conv_state.is_contiguous():
            raise ValueError(
                f"causal_conv1d: conv_state must be contiguous [slots, {cd}, {kw - 1}], got {tuple(conv_state.shape)}"
            )
    elif starts is not None and bool((starts > 0).any()):
        raise ValueError("sequences starting at positions > 0 need their conv state (conv_state=..., slots=...)")
    x = x.contiguous()
    y = torch.empty_like(x)
    n = cu_seqlens.numel() - 1
    if t == 0:
        return y
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    sid = torch.searchsorted(cu[1:], torch.arange(t, device=x.device, dtype=torch.int32), right=True).to(torch.int32)
    has = conv_state is not None
    st = (starts if starts is not None else torch.zeros(n, dtype=torch.int64)).to(device=x.device, dtype=torch.int64)
    sl = slots.to(device=x.device, dtype=torch.int64) if has else st
    cs = conv_state if has else x
    grid = (t, triton.cdiv(cd, CONV_BC))
    _conv_kernel[grid](x, weight.contiguous(), y, sid, cu, st, sl, cs, cd, K=kw, HAS_STATE=has, BC=CONV_BC)
    if has:
        kp = triton.next_power_of_2(max(kw - 1, 1))
        _conv_state_kernel[(n, triton.cdiv(cd, CONV_BC))](x, cu, st, sl, conv_state, cd, K=kw, KP=kp, BC=CONV_BC)
    return y


def _conv_plain(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Differentiable conv + SiLU for the backward: shifted copies by pad/slice (no scatter, so the
    gradient is deterministic), zeroed before each sequence's start."""
    t = x.shape[0]
    kw = weight.shape[-1]
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    ar = torch.arange(t, device=x.device)
    pos = ar - cu[torch.searchsorted(cu[1:], ar, right=True)]
    xf, wf = x.float(), weight.float()
    acc = None
    for j in range(kw):
        shift = kw - 1 - j
        xs = torch.nn.functional.pad(xf, (0, 0, shift, 0))[:t] * (pos >= shift)[:, None]
        term = wf[:, j] * xs
        acc = term if acc is None else acc + term
    return torch.nn.functional.silu(acc).to(x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU (``x [T, Cd]``, ``weight [Cd, K]``); updates ``conv_state`` like the reference."""
    fwd = functools.partial(_conv_forward, conv_state=conv_state, slots=slots, starts=starts)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not needs_grad:
        return fwd(x, weight, cu_seqlens)
    if conv_state is not None:
        raise NotImplementedError(
            "causal_conv1d (triton): gradients through a call with a conv state are not supported"
        )
    return with_plain_backward(fwd, _conv_plain, x, weight, cu_seqlens)


def _l2norm_forward(x: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = xc.numel() // max(d, 1)
    if rows:
        _l2norm_kernel[(rows,)](xc, y, d, float(eps), BD=triton.next_power_of_2(d))
    return y


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fp32 ``x / sqrt(sum(x^2) + eps)`` over the last dim: one row per program, fixed block."""
    return with_plain_backward(_l2norm_forward, native.l2norm, x, eps)


def _gates_forward(a, b, A_log, dt_bias):
    t, h = a.shape
    g = torch.empty(t, h, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if a.numel():
        _gates_kernel[(triton.cdiv(a.numel(), ELEM_BLOCK),)](
            a.contiguous(), b.contiguous(), A_log.contiguous(), dt_bias.contiguous(), g, beta, a.numel(), h,
            BLOCK=ELEM_BLOCK,
        )  # fmt: skip
    return torch.stack([g, beta])


def _gates_plain(a, b, A_log, dt_bias):
    return torch.stack(native.gdn_gates(a, b, A_log, dt_bias))


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp64 inside) and ``beta = sigmoid(b)``; elementwise."""
    if a.shape != b.shape or a.dim() != 2 or A_log.shape != (a.shape[1],) or dt_bias.shape != (a.shape[1],):
        raise ValueError(
            f"gdn_gates: a{tuple(a.shape)} b{tuple(b.shape)} must be [T, Hv] and A_log{tuple(A_log.shape)} "
            f"dt_bias{tuple(dt_bias.shape)} [Hv]"
        )
    out = with_plain_backward(_gates_forward, _gates_plain, a, b, A_log, dt_bias)
    return out[0], out[1]


# ----------------------------------------------------------------------------------- registry
def _probe_rule() -> dict[str, torch.Tensor]:
    from megatron_iso.ops.gdn.reference import l2norm as l2_ref

    gen = torch.Generator().manual_seed(4021)
    t, hk, hv, d = 45, 2, 4, 32
    q = l2_ref(torch.randn(t, hk, d, generator=gen)).cuda()
    k = l2_ref(torch.randn(t, hk, d, generator=gen)).cuda()
    v = torch.randn(t, hv, d, generator=gen).cuda()
    g, beta = gdn_gates(torch.randn(t, hv, generator=gen).cuda(), torch.randn(t, hv, generator=gen).cuda(),
                        torch.zeros(hv, device="cuda"), torch.ones(hv, device="cuda"))  # fmt: skip
    cu = torch.tensor([0, 19, 45], device="cuda")
    return {"chunk16": gated_delta_rule(q, k, v, g, beta, cu, chunk=16).cpu()}


def _probe_conv() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4022)
    x, w = torch.randn(11, 300, generator=gen).cuda(), torch.randn(300, 4, generator=gen).cuda()
    cu = torch.tensor([0, 2, 11], device="cuda")
    return {"fp32": causal_conv1d(x, w, cu).cpu(), "bf16": causal_conv1d(x.bfloat16(), w.bfloat16(), cu).cpu()}


def _probe_gates() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4023)
    a, b = torch.randn(9, 4, generator=gen).cuda() * 4, torch.randn(9, 4, generator=gen).cuda()
    g, beta = gdn_gates(a, b, torch.randn(4, generator=gen).cuda(), torch.randn(4, generator=gen).cuda())
    return {"g": g.cpu(), "beta": beta.cpu(), "l2norm": l2norm(torch.randn(5, 3, 128, generator=gen).cuda()).cpu()}


_RULE_CONSTANTS = {
    "chunk_alignment": "position 0 of the sequence",
    "state_pass": "per chunk (closing chunks; chunk form: every chunk, rows past nrows zero): G by an ieee dot with "
    "the lower-triangular ones, T^-1's 16-row diagonal blocks X_bb by tl.fma chains over the rows above; scan form: WY "
    "form, block rows below by K-blocked dots, U0/W by dots, chain u = U0 - W E (ieee: K-blocked through memory, "
    "tensor-core precisions: whole-K dots from registers); chunk form: chain u by block forward substitution "
    "Y_b = beta v - (beta e^G k) E - sum_j<b A_bj u_j, u_b = X_bb Y_b (16-row blocks in registers); "
    "E' = e^G_C E + KD^T u; one program per (seq, head, Dv block)",
    # The form and the precision are the profile's (profile.gdn_form, profile.gdn_dot_precision, pinned constants of
    # the same contract); here what a null precision means per form.
    "form": "profile.gdn_form (scan or chunk)",
    "dot_precision": "profile.gdn_dot_precision (null: the form's default)",
    "dot_precision_defaults": [f"scan:{DOT_PRECISION}", f"chunk:{CHUNK_DOT_PRECISION}"],
    "chunk_form_precisions": list(CHUNK_FORM_PRECISIONS),
    "output": "scan: per-token recurrent scan from the chunk entry (or running) state, S[Dk, BV] in registers; "
    "chunk: O = e^G (Q E) + P u per (chunk, head, Dv block)",
    "decode": "scan: one scan step from the running state, state pass kernels re-run on the buffered chunk at its "
    "close; chunk: the token's X_bb row from the cached rows (the prep's fma chain), its A and P rows, its Y, u and o "
    "rows through the chain's 16-row tiles (Y, u rows cached), the exit at close",
    "decode_bv": DECODE_BV,
    "fp_contraction": "chunk form: off (enable_fp_fusion=False for prep, chain, output and decode kernels); scan: on",
    "decode_sum_one_dot": DECODE_SUM_ONE_DOT,  # the decode step's substitution sum as one dot (k_chain probe)
    "scan_bv": SCAN_BV,
    "inv_block": INV_BLOCK,
    "chain_bv_ieee_mma_bf16": [CHAIN_BV, CHAIN_BV_MMA, CHAIN_BV_BF16],  # the chain's Dv block per dot path
    "out_bv_decode_rows": [OUT_BV, DECODE_ROWS],
    "warps_scan_chain_prep_out": [SCAN_WARPS, CHAIN_WARPS, PREP_WARPS, OUT_WARPS],
    "block_k": "max(16, next_pow2(Dk))",
    "exp": "tl.exp (fp32)",
    "inputs": "read in their own dtype (fp32/bf16/fp16, widened in-kernel) at their row stride; other dtypes or "
    "non-contiguous inner dims copied to contiguous fp32",
    "chunk_buffer": "scan: written by the scan kernel (after prep); chunk: by _buffer_kernel, last",
    "intermediates": "bf16 chain dots: W, KD (chunk form: u, entry states) stored as bf16, the dots' own rounding; "
    "else fp32",
    "backward": "triton chunk backward (gdn_triton_backward: local, chain, output, WY kernels) at the chain's "
    "precision, from the chunk-form state pass (kept by the chunk form, recomputed after the scan form)",
    "triton": triton.__version__,
}
for _op, _fn, _probe, _consts in (
    ("gated_delta_rule", gated_delta_rule, _probe_rule, _RULE_CONSTANTS),
    ("gdn_conv1d", causal_conv1d, _probe_conv,
     {"sum": "sequential fp32 over K (FMA contraction allowed)", "silu": "acc / (1 + tl.exp(-acc)), div_rn",
      "block_channels": CONV_BC, "triton": triton.__version__}),
    ("gdn_gates", gdn_gates, _probe_gates,
     {"formula": "g: fp64 -exp(A_log) * (max(x,0) + log1p(exp(-|x|))), log1p = log(u) y/(u-1), rounded once; "
                 "beta: fp32 1/(1+exp(-b)) div_rn",
      "block": ELEM_BLOCK, "triton": triton.__version__}),
    ("gdn_l2norm", l2norm, _probe_gates,
     {"eps": L2NORM_EPS, "reduction": "one row per program, tl.sum over next_pow2(D)", "sqrt_div": "sqrt_rn, div_rn",
      "triton": triton.__version__}),
):  # fmt: skip
    register(
        OpImpl(
            op=_op,
            impl_id=f"{_op}.triton",
            version=VERSION,
            device_class="cuda",
            profile="correctness",
            fn=_fn,
            constants=_consts,
            equivalence_note=(
                "training, prefill and decode run the same kernels: the per-token scan from a bitwise-equal start "
                "state, the state-pass kernels on the same (entry, chunk) data (tests/gpu/test_gdn_triton.py)"
            ),
            probe=_probe,
        )
    )
