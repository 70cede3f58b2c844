"""Bitwise claims of the Triton (GPU correctness-profile) kernels, on a CUDA device.

Compared as bit patterns, never with a tolerance, except the accuracy checks against fp64.
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from megatron_iso.ops.logprob.slice_exp_triton import LOG2E, ex2_ftz  # noqa: E402

DTYPES = (torch.bfloat16, torch.float32)
MS = (1, 2, 3, 7, 8, 64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _rand(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(dtype)


# ------------------------------------------------------------------ GEMM
@pytest.fixture(scope="module")
def gemm():
    from megatron_iso.ops.gemm.gemm_triton import leaf_tree_linear_triton

    return leaf_tree_linear_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leaves", [1, 2, 8])
def test_gemm_batch_invariance(gemm, dtype, leaves):
    x, w = _rand((300, 1024), dtype, 1), _rand((640, 1024), dtype, 2)
    full = gemm(x, w, leaves)
    for m in MS:
        assert _same(gemm(x[:m], w, leaves), full[:m]), f"M={m}"
    perm = torch.randperm(300, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    assert _same(gemm(x[perm], w, leaves), full[perm])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_schedule_never_changes_bits(gemm, dtype):
    x, w = _rand((200, 2048), dtype, 4), _rand((384, 2048), dtype, 5)
    base = gemm(x, w, 8, parallel=1)
    for p in (2, 4, 8):
        assert _same(gemm(x, w, 8, parallel=p), base), f"parallel={p}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gemm_tp_subtrees(gemm, dtype, tp):
    from megatron_iso.ops.common.tree import tree_sum

    K = 4096
    x, w = _rand((33, K), dtype, 6), _rand((256, K), dtype, 7)
    full = gemm(x, w, 8)
    s = K // tp
    nodes = [gemm(x[:, r * s : (r + 1) * s], w[:, r * s : (r + 1) * s], 8 // tp) for r in range(tp)]
    assert _same(tree_sum(nodes), full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_accuracy_vs_fp64(gemm, dtype):
    x, w = _rand((129, 4096), dtype, 8), _rand((520, 4096), dtype, 9)
    ref = x.double() @ w.double().t()
    out = gemm(x, w, 8)
    assert out.dtype == torch.float32
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_gemm_bad_input(gemm):
    x, w = _rand((4, 96), torch.bfloat16, 0), _rand((8, 96), torch.bfloat16, 0)
    with pytest.raises(ValueError, match="leaves=3"):
        gemm(x, w, 3)
    with pytest.raises(ValueError, match="not divisible"):
        gemm(_rand((4, 100), torch.bfloat16, 0), _rand((8, 100), torch.bfloat16, 0), 8)
    with pytest.raises(TypeError, match="int8|dtype"):
        gemm(x.to(torch.int8), w.to(torch.int8), 1)


# ------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_rmsnorm_batch_invariance_and_accuracy(dtype, zero_centered, gated):
    from megatron_iso.ops.norm.norm_triton import gated_rms_norm_triton, rms_norm_triton

    H = 2048
    x, z, w = _rand((100, H), dtype, 10), _rand((100, H), dtype, 11), _rand((H,), dtype, 12) * 0.1

    def f(a, g):
        if gated:
            return gated_rms_norm_triton(a, g, w, 1e-6, zero_centered=zero_centered)
        return rms_norm_triton(a, w, 1e-6, zero_centered=zero_centered)

    full = f(x, z)
    for m in MS:
        assert _same(f(x[:m], z[:m]), full[:m]), f"M={m}"
    perm = torch.randperm(100, device="cuda")
    assert _same(f(x[perm], z[perm]), full[perm])
    xd = x.double()
    ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * ((1 + w.double()) if zero_centered else w.double())
    if gated:
        ref = ref * torch.nn.functional.silu(z.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((full.double() - ref).norm() / ref.norm()) < tol


# ------------------------------------------------------------------ logprob
@pytest.mark.parametrize("dtype", DTYPES)
def test_logprob_invariance_and_accuracy(dtype):
    from megatron_iso.ops.logprob.logprob_triton import TritonScores, token_logprobs_triton
    from megatron_iso.ops.logprob.reference import LocalShards, VocabScores

    V = 32768
    logits = (_rand((70, V), torch.float32, 13) * 4).to(dtype)
    ids = torch.randint(0, V, (70,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(14))
    full = token_logprobs_triton([logits], ids, temperature=0.7, leaves=8)
    for m in MS:
        assert _same(token_logprobs_triton([logits[:m]], ids[:m], temperature=0.7, leaves=8), full[:m]), f"M={m}"
    for tp in (2, 4, 8):  # the split row statistics around the collectives, and the torch token steps
        shards = list(logits.chunk(tp, dim=-1))
        assert _same(token_logprobs_triton(shards, ids, temperature=0.7, leaves=8), full), f"TP={tp}"
    one = TritonScores(logits.unsqueeze(0), LocalShards(1), temperature=0.7, leaves=8)
    assert _same(VocabScores.token_logprobs(one, ids), full), "the token kernel against its torch steps"
    ref = torch.log_softmax(logits.double() / 0.7, dim=-1).gather(-1, ids[:, None].long()).squeeze(-1)
    assert float((full.double() - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [0.7, 0.6, 1.3])
def test_logprob_reciprocal_division_is_div_rn(dtype, t):
    """At a Python-number temperature the kernel divides by a reciprocal the device checked over every 16-bit
    logit; the check passes on this GPU, and the scores' bits equal those of a temperature tensor (div_rn)."""
    from megatron_iso.ops.logprob.logprob_triton import TritonScores
    from megatron_iso.ops.logprob.reference import LocalShards
    from megatron_iso.ops.logprob.temperature_triton import reciprocal_for

    assert reciprocal_for(t, dtype, torch.device("cuda")) is not None, "the device check refused the reciprocal"
    x = _rand((64, 151936), torch.float32, 16) * 5
    x[0, :512] = 0.0
    x[1] = 1.1387602e-38  # a subnormal whose slices must divide
    x[2, ::101] = 3.0e38  # quotients that overflow
    x = x.to(dtype).unsqueeze(0)
    fast = TritonScores(x, LocalShards(1), temperature=t, leaves=8)
    divided = TritonScores(x, LocalShards(1), temperature=torch.full((64, 1), t, device="cuda"), leaves=8)
    assert _same(fast.m, divided.m) and _same(fast.lse, divided.lse)


@triton.jit
def _ex2_disagreements_kernel(out_ptr, FIRST_BITS, N, BLOCK: tl.constexpr):
    # out[program]: how many y of this block (fp32 bit patterns FIRST_BITS + i, i < N) where ex2.approx.ftz.f32
    # differs from ex2.approx.f32, plus how many where tl.exp(y) differs from ex2.approx.f32(y * log2(e)).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    y = (FIRST_BITS + i).to(tl.uint32).to(tl.float32, bitcast=True)
    exact = tl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32, is_pure=True, pack=1)
    flushed = ex2_ftz(y)
    via_exp = tl.exp(y)
    lowered = tl.inline_asm_elementwise(
        "ex2.approx.f32 $0, $1;", "=f,f", [y * LOG2E], dtype=tl.float32, is_pure=True, pack=1
    )
    bad = (exact.to(tl.int32, bitcast=True) != flushed.to(tl.int32, bitcast=True)) | (
        via_exp.to(tl.int32, bitcast=True) != lowered.to(tl.int32, bitcast=True)
    )
    tl.store(out_ptr + tl.program_id(0), tl.sum((bad & ok).to(tl.int32), axis=0))


def test_ex2_flush_changes_nothing_above_the_normal_range():
    """slice_exp_triton's premise, on every fp32 y in [-126, -0]: ex2.approx.ftz.f32 (MUFU.EX2 alone) gives the bits
    of ex2.approx.f32 (with its subnormal fix-up), and tl.exp(y) is ex2.approx.f32(y * log2(e))."""
    first = 0x80000000  # -0.0; the patterns up to -126.0 are every fp32 in [-126, -0]
    n = 0xC2FC0000 - first + 1
    block = 4096
    out = torch.empty(triton.cdiv(n, block), dtype=torch.int32, device="cuda")
    _ex2_disagreements_kernel[(out.numel(),)](out, first, n, BLOCK=block)
    assert int(out.sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_logprob_slice_exp_keeps_tl_exp_bits(dtype):
    """The leaf kernel's per-slice choice of the flushing ex2 (slice_exp_triton) gives tl.exp's bits: the leaf
    statistics equal those of the kernel with tl.exp in every slice, at t = 1, at a number temperature (the
    reciprocal form) and at a tensor temperature, with slices on both sides of the -126 bound and logits that
    are infinite, tiny or zero."""
    from megatron_iso.ops.logprob.logprob_triton import launch_leaf_kernel
    from megatron_iso.ops.logprob.temperature_triton import division_args

    rows, V, leaves = 16, 151936, 8
    x = _rand((rows, V), torch.float32, 21) * 3
    x[1, ::7] = -200.0  # spread past 87 in every slice of the row
    x[2, 5000:5100] = 150.0  # one leaf whose max jumps: the slices before it are near, those after it far
    x[3, :2048] = 0.0
    x[4, 100] = 1e-30
    x[5, 3] = float("-inf")
    x[6] = -1.0e4  # a row far below zero: the max is too
    x[7, 9000] = float("inf")
    x = x.to(dtype).unsqueeze(0)
    for t in (1.0, 0.7):
        t_rows = torch.full((rows,), t, device="cuda")
        for scalar in (t, None):  # a number temperature (the reciprocal form where checked), then a tensor one
            division = division_args(scalar, dtype, x.device)
            outs = []
            for asm in (True, False):
                per_leaf = torch.empty((1, rows, leaves, 2), device="cuda", dtype=torch.float32)
                launch_leaf_kernel(x, t_rows, per_leaf, V, 0, division, asm=asm)
                outs.append(per_leaf)
            assert _same(*outs), (dtype, t, scalar)


def test_logprob_valid_vocab_masks_padding():
    from megatron_iso.ops.logprob.logprob_triton import token_logprobs_triton

    logits = _rand((5, 4096), torch.float32, 15)
    ids = torch.tensor([0, 1, 2, 3, 4], device="cuda")
    out = token_logprobs_triton([logits], ids, leaves=8, valid_vocab=4000)
    ref = torch.log_softmax(logits[:, :4000].double(), dim=-1)[torch.arange(5), ids]
    assert float((out.double() - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprob_minus_inf_logits_add_nothing(dtype):
    """-inf logits (a vocab mask) at Qwen3's vocab: a leaf's first slices, a whole leaf, single entries, at 1 and
    64 rows (4 warps) and 300 (one warp), at t = 1 and a checked number t = 0.7: finite where fp64 is, within fp64
    tolerance, and the same bits over batch and vocab shards."""
    from megatron_iso.ops.logprob.logprob_triton import token_logprobs_triton

    V, leaf = 151936, 151936 // 8
    x = (_rand((300, V), torch.float32, 23) * 4).to(dtype)
    x[0, :1500] = float("-inf")
    x[1, leaf : 2 * leaf] = float("-inf")
    x[2, 7] = x[2, 3 * leaf] = float("-inf")
    x[3, :leaf] = float("-inf")
    x[3, 5] = 2.0  # one finite logit after -inf ones in the same first slice
    ids = torch.tensor([2000, 5, 9, 5] + [11] * 296, device="cuda")
    for t in (1.0, 0.7):
        full = token_logprobs_triton([x], ids, temperature=t, leaves=8)
        exact = torch.log_softmax(x.double() / t, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
        assert bool(torch.isfinite(full).all()), full[:4]
        assert float((full.double() - exact).abs().max()) < 1e-4, t
        for m in (1, 64):
            assert _same(token_logprobs_triton([x[:m]], ids[:m], temperature=t, leaves=8), full[:m]), (t, m)
        assert _same(token_logprobs_triton(list(x.chunk(4, -1)), ids, temperature=t, leaves=8), full), t


def test_scoring_runs_triton_scores_with_the_plain_backward():
    """``vocab_scoring.token_logprobs`` on CUDA (what the rollout records and the trainer recomputes) is the
    Triton kernel's forward, the same bits for any batch at Qwen3's vocab, with the native formula's gradient."""
    from megatron_iso.ops.logprob.logprob_triton import token_logprobs_triton
    from megatron_iso.parallel.vocab_scoring import token_logprobs

    V = 151936
    logits = (_rand((256, V), torch.float32, 21) * 4).to(torch.bfloat16)
    ids = torch.randint(0, V, (256,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(22))
    full = token_logprobs(logits, ids, temperature=0.8)
    assert _same(full, token_logprobs_triton(logits, ids, temperature=0.8))
    for m in (1, 3, 64):
        assert _same(token_logprobs(logits[:m], ids[:m], temperature=0.8), full[:m]), f"M={m}"
    x = logits.float().requires_grad_()
    got = token_logprobs(x, ids, temperature=0.8)
    assert _same(got, token_logprobs(logits.float(), ids, temperature=0.8))
    got.sum().backward()
    p = torch.softmax(logits.double() / 0.8, -1)
    expected = (torch.nn.functional.one_hot(ids, V) - p) / 0.8
    assert float((x.grad.double() - expected).abs().max()) < 1e-5
