"""The one-pass entropy statistic (ops/logprob/entropy.py): accuracy against fp64, and the same bits for
any batch and any split of the vocab leaves over shards; its Triton kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import textwrap

import pytest
import torch

from megatron_iso.ops.logprob.entropy import entropy_from_partials, entropy_partials_reference, row_entropy
from megatron_iso.testing.bits import same_bits


def _exact(logits: torch.Tensor, temperature: torch.Tensor, valid: int) -> torch.Tensor:
    z = logits.double() / temperature.double().reshape(-1, 1)
    z[:, valid:] = float("-inf")
    logp = torch.log_softmax(z, -1)
    return -torch.where(logp.isneginf(), torch.zeros_like(logp), logp.exp() * logp).sum(-1)


def _split(logits, temperature, leaves, valid, world):
    shard = logits.shape[-1] // world
    parts = [
        entropy_partials_reference(
            logits[:, r * shard : (r + 1) * shard], temperature, leaves // world, valid, r * shard
        )
        for r in range(world)
    ]
    return entropy_from_partials(torch.cat(parts, dim=1))


def test_reference_is_accurate_and_layout_free():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4096, generator=g) * 4
    logits[1] = -30.0  # a flat row: entropy log(valid)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0, 1.0])
    valid = 4000  # padding ids masked
    ent = row_entropy(logits, temperature=temperature.unsqueeze(-1), leaves=8, valid_vocab=valid)
    assert (ent.double() - _exact(logits, temperature, valid)).abs().max() < 1e-5
    assert abs(float(ent[1]) - float(torch.log(torch.tensor(float(valid), dtype=torch.float64)))) < 1e-5
    for world in (2, 4, 8):
        assert same_bits(_split(logits, temperature, 8, valid, world), ent), world
    for rows in (1, 3):
        part = row_entropy(logits[-rows:], temperature=temperature[-rows:].unsqueeze(-1), leaves=8, valid_vocab=valid)
        assert same_bits(part, ent[-rows:]), rows


def test_bad_leaves_and_vocab_are_refused():
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="leaves"):
        row_entropy(x, leaves=5)
    with pytest.raises(ValueError, match="valid_vocab"):
        row_entropy(x, leaves=8, valid_vocab=200)


pytest.importorskip("triton")
from megatron_iso.testing.triton_interpret import run_interpreted  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.ops.logprob.entropy import entropy_from_partials, entropy_partials_reference
    from megatron_iso.ops.logprob.entropy_triton import entropy_partials_triton

    b = lambda t: t.view(torch.int32)

    def assert_sums_close(got, ref):  # s and u of every leaf within 1e-4 of fp64, relative
        rel = (got[..., 1:].double() - ref[..., 1:].double()).abs() / ref[..., 1:].double().abs().clamp_min(1e-30)
        assert rel.max() < 1e-4, float(rel.max())

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 8 * 2500, generator=g) * 3).to(torch.bfloat16)
    t = torch.tensor([1.0, 0.6, 1.7, 1.0])
    valid = 8 * 2500 - 77
    got = entropy_partials_triton(x, t, 8, valid, 0)
    ref = entropy_partials_reference(x, t, 8, valid, 0)
    assert torch.equal(b(got[..., 0]), b(ref[..., 0])), "leaf max"
    assert_sums_close(got, ref)
    ent, ent_ref = entropy_from_partials(got), entropy_from_partials(ref)
    assert (ent - ent_ref).abs().max() < 1e-4, (ent, ent_ref)
    shards = [entropy_partials_triton(x[:, r * 10000 : (r + 1) * 10000], t, 4, valid, r * 10000) for r in range(2)]
    assert torch.equal(b(torch.cat(shards, dim=1)), b(got)), "two shards != one"
    assert torch.equal(b(entropy_partials_triton(x[2:], t[2:], 8, valid, 0)), b(got[2:])), "batch"
    # -inf logits (a lane's first entry, a later one, a whole leaf but one entry) add nothing, as in the reference
    xi = x.clone()
    xi[0, 5] = xi[1, 3000] = float("-inf")
    xi[2, 2500 : 2 * 2500 - 1] = float("-inf")
    got, ref = entropy_partials_triton(xi, t, 8, valid, 0), entropy_partials_reference(xi, t, 8, valid, 0)
    assert torch.isfinite(got).all(), got
    assert_sums_close(got, ref)
    print("OK")
    """
)


def test_triton_kernel_under_interpreter():
    proc = run_interpreted(SCRIPT, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
