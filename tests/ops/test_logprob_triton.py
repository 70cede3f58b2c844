"""The CUDA correctness profile's scoring kernel (``ops.logprob.logprob_triton``) under TRITON_INTERPRET=1: its
bits are the same for any batch, any rows beside a row and any split of the vocab over shards, and its values
agree with fp64 and with the torch reference. tests/gpu/test_logprob_triton.py holds the compiled kernel to
the same claims at Qwen3's vocab."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")
from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.logprob import LocalShards, VocabScores
    from megatron_iso.ops.logprob.logprob_triton import TritonScores, token_logprobs_triton

    b = lambda t: t.view(torch.int32)
    g = torch.Generator().manual_seed(3)
    V, valid = 8 * 2500, 8 * 2500 - 77  # leaves of 2500: a partial last block of lanes; padding ids masked
    x = (torch.randn(2, 3, V, generator=g) * 4).to(torch.bfloat16)
    ids = torch.randint(0, valid, (2, 3), generator=g)
    t = torch.tensor([[[0.7]], [[1.3]]])  # per sequence, broadcast over its 3 tokens
    full = token_logprobs_triton(x, ids, temperature=t, leaves=8, valid_vocab=valid)

    # fp64 and the torch reference (another summation order, so a tolerance, not bits)
    z = x.double() / t.double()
    z[..., valid:] = float("-inf")
    exact = (z - torch.logsumexp(z, -1, keepdim=True)).gather(-1, ids[..., None]).squeeze(-1)
    assert (full.double() - exact).abs().max() < 2e-5, (full, exact)
    ref = VocabScores(x.unsqueeze(0), LocalShards(1), temperature=t, leaves=8, valid_vocab=valid)
    assert (full - ref.token_logprobs(ids)).abs().max() < 2e-5

    # batch: a sequence alone, a token alone, the rows flattened
    assert torch.equal(b(token_logprobs_triton(x[1:], ids[1:], temperature=t[1:], leaves=8, valid_vocab=valid)), b(full[1:]))
    one = token_logprobs_triton(x[1, 2:], ids[1, 2:], temperature=1.3, leaves=8, valid_vocab=valid)
    assert torch.equal(b(one), b(full[1, 2:])), "one token"
    # vocab shards: 2 and 4 ranks' shards (4 and 2 leaves each) equal one shard of 8 leaves
    for c in (2, 4):
        got = token_logprobs_triton(list(x.chunk(c, -1)), ids, temperature=t, leaves=8, valid_vocab=valid)
        assert torch.equal(b(got), b(full)), f"{c} shards"

    # log_softmax and entropy from the same lse; a padding id scores -inf
    scores = TritonScores(x.unsqueeze(0), LocalShards(1), temperature=t, leaves=8, valid_vocab=valid)
    ls = scores.log_softmax().squeeze(0)
    assert torch.equal(b(ls.gather(-1, ids[..., None]).squeeze(-1)), b(full)), "log_softmax at the ids"
    assert torch.isneginf(ls[..., valid:]).all()
    ent = scores.entropy().squeeze(0)
    p = torch.softmax(z, -1)
    assert (ent.double() - (-(p * torch.log_softmax(z, -1)).nan_to_num().sum(-1))).abs().max() < 1e-4
    pad = torch.full_like(ids, V - 1)
    assert torch.isneginf(scores.token_logprobs(pad)).all()

    # -inf logits (a user's vocab mask) add nothing, as in fp64: a leaf's first slice and more, a whole leaf (its
    # masked tail slice too), single entries; before any finite logit a slice of -infs must not give exp(NaN)
    xi = x.clone()
    xi[0, 0, :1100] = float("-inf")
    xi[0, 1, 2500:5000] = float("-inf")
    xi[1, 0, 7] = xi[1, 0, 4999] = float("-inf")
    xi[1, 1, 7500:10000] = float("-inf")
    got = token_logprobs_triton(xi, ids, temperature=t, leaves=8, valid_vocab=valid)
    zi = xi.double() / t.double()
    zi[..., valid:] = float("-inf")
    exact = (zi - torch.logsumexp(zi, -1, keepdim=True)).gather(-1, ids[..., None]).squeeze(-1)
    finite = torch.isfinite(exact)
    assert finite.any() and torch.equal(torch.isfinite(got), finite), (got, exact)
    assert (got[finite].double() - exact[finite]).abs().max() < 2e-5, (got, exact)
    halves = token_logprobs_triton(list(xi.chunk(2, -1)), ids, temperature=t, leaves=8, valid_vocab=valid)
    assert torch.equal(b(halves), b(got)), "-inf logits, 2 shards"

    # forward only: a gradient through it is refused, not silently wrong
    try:
        TritonScores(x.float().requires_grad_().unsqueeze(0), LocalShards(1), leaves=8)
    except RuntimeError as exc:
        assert "forward only" in str(exc)
    else:
        raise AssertionError("requires_grad logits were accepted")
    print("OK")
    """
)


def test_triton_scores_under_interpreter():
    proc = run_interpreted(SCRIPT, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


ONE_SHARD_KERNELS = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.logprob import LocalShards, VocabScores
    from megatron_iso.ops.logprob.logprob_triton import TritonScores

    b = lambda t: t.view(torch.int32)
    g = torch.Generator().manual_seed(5)
    rows, V, valid = 300, 8 * 96, 8 * 96 - 40  # 300 rows: several row programs and a partial one
    t = (0.3 + 1.4 * torch.rand(rows, 1, generator=g))  # per-row temperatures: most quotients are inexact
    ids = torch.randint(0, V, (rows,), generator=g)  # some padding ids among them
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(rows, V, generator=g) * 5).to(dtype)
        one = TritonScores(x.unsqueeze(0), LocalShards(1), temperature=t, leaves=8, valid_vocab=valid)
        two = TritonScores(torch.stack(x.chunk(2, -1)), LocalShards(2), temperature=t, leaves=8, valid_vocab=valid)
        # the one-launch row statistics against the rank sum and log around the collectives
        assert torch.equal(b(one.m), b(two.m)) and torch.equal(b(one.lse), b(two.lse)), dtype
        # the token kernel against the torch gather, division and subtraction it replaces
        assert torch.equal(b(one.token_logprobs(ids)), b(VocabScores.token_logprobs(one, ids))), dtype
        assert torch.equal(b(one.token_logprobs(ids)), b(two.token_logprobs(ids))), dtype
        assert torch.isneginf(one.token_logprobs(ids)[ids >= valid]).all() and (ids >= valid).any()
    print("OK")
    """
)


def test_one_shard_kernels_equal_the_split_form():
    """With the whole vocab in one shard the row statistics and the token logprob are one launch each; their bits
    equal the form that runs across vocab shards (and the torch ops of the token logprob), row by row."""
    proc = run_interpreted(ONE_SHARD_KERNELS, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


FAST_DIVISION = textwrap.dedent(
    """
    import sys
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds, fuse_interpreted_fma

    allow_runtime_loop_bounds()
    if sys.argv[1] == "fused":
        fuse_interpreted_fma()

    import torch
    from megatron_iso.ops.logprob.entropy_triton import entropy_partials_triton
    from megatron_iso.ops.logprob.logprob_triton import TritonScores
    from megatron_iso.ops.logprob.reference import LocalShards
    from megatron_iso.ops.logprob.temperature_triton import reciprocal_for

    b = lambda t: t.view(torch.int32)
    g = torch.Generator().manual_seed(5)
    V = 8 * 2100
    x = torch.randn(4, V, generator=g) * 6
    x[0, :40] = 0.0
    x[0, 40:80] = -0.0
    x[1, 3000] = 1e-30  # a nonzero logit below TINY: its slice divides
    x[2, ::97] = 200.0
    x[2, 5] = float("inf")  # an infinite logit: its slice divides too (both forms give inf)
    # a bf16 subnormal whose quotient by 0.7 the reciprocal form gets wrong: its slices must divide, and the
    # row's max (m) is that quotient
    x[3] = 1.1387602e-38
    verdicts = {}
    for dtype in (torch.bfloat16, torch.float16):
        xs = x.to(dtype).unsqueeze(0)
        assert reciprocal_for(2.0, dtype, xs.device) is None  # an exact reciprocal: the kernels divide
        for t in (0.7, 0.6, 1.3, 0.95, 2.0, 1e-3, 7.3):
            if t != 2.0:
                verdicts[(dtype, t)] = reciprocal_for(t, dtype, xs.device) is not None
            fast = TritonScores(xs, LocalShards(1), temperature=t, leaves=8)
            # a temperature tensor never takes the reciprocal form: div_rn in every slice
            divided = TritonScores(xs, LocalShards(1), temperature=torch.full((4, 1), t), leaves=8)
            assert torch.equal(b(fast.lse), b(divided.lse)), (dtype, t)
            assert torch.equal(b(fast.m), b(divided.m)), (dtype, t)
            # the entropy statistic's leaf partials: the same division, so the same bits either way
            rows_t = torch.full((4,), t)
            parts = entropy_partials_triton(xs[0], rows_t, 8, V, 0, scalar_temperature=t)
            assert torch.equal(b(parts), b(entropy_partials_triton(xs[0], rows_t, 8, V, 0))), ("entropy", dtype, t)
    print("VERDICTS", all(verdicts.values()))
    """
)


@pytest.mark.parametrize("fma", ["fused", "interpreted"])
def test_reciprocal_division_gives_div_rn_bits(fma):
    """At a Python-number temperature the kernel divides by a checked reciprocal: with an IEEE fma (the GPU's) the
    device check passes at every temperature tried and the lse's bits equal div_rn's; with the interpreter's
    two-rounding fma the check must refuse it at some temperature, and the bits still hold (it divides)."""
    proc = run_interpreted(FAST_DIVISION, args=[fma], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICTS"))
    all_passed = line.split()[1] == "True"
    if fma == "fused":
        assert all_passed, line
    else:
        assert not all_passed, f"a two-rounding fma passed the check everywhere: the check cannot fail ({line})"
