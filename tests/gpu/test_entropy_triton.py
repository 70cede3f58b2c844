"""The entropy statistic's Triton kernel on a CUDA device: fp64 accuracy, and the same bits for any batch and
any split of the vocab over shards (the scoring path's entropy on CUDA)."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_entropy_kernel_matches_fp64_and_is_layout_free(dtype):
    from megatron_iso.ops.logprob.entropy import entropy_from_partials, entropy_partials_reference, row_entropy
    from megatron_iso.ops.logprob.entropy_triton import entropy_partials_triton
    from megatron_iso.parallel.vocab_scoring import entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, valid = 151936, 151669  # Qwen3's padded vocab and its real ids
    x = (torch.randn(257, vocab, device="cuda", generator=g) * 4).to(dtype)
    t = torch.rand(257, device="cuda", generator=g) + 0.5
    ent = row_entropy(x, temperature=t.unsqueeze(-1), leaves=8, valid_vocab=valid)
    ref = entropy_from_partials(entropy_partials_reference(x, t, 8, valid, 0))
    assert (ent.double() - ref.double()).abs().max() < 1e-4
    assert same_bits(entropy(x, temperature=t.unsqueeze(-1), leaves=8, valid_vocab=valid), ent)
    for world in (2, 4):
        shard = vocab // world
        parts = [entropy_partials_triton(x[:, r * shard : (r + 1) * shard], t, 8 // world, valid, r * shard)
                 for r in range(world)]  # fmt: skip
        assert same_bits(entropy_from_partials(torch.cat(parts, dim=1)), ent), world
    for rows in (1, 64):
        got = row_entropy(x[-rows:], temperature=t[-rows:].unsqueeze(-1), leaves=8, valid_vocab=valid)
        assert same_bits(got, ent[-rows:]), rows
    again = row_entropy(x, temperature=t.unsqueeze(-1), leaves=8, valid_vocab=valid)
    assert same_bits(again, ent)


def test_entropy_at_a_number_temperature_equals_the_tensor_form():
    """A Python-number temperature lets the kernel divide by a device-checked reciprocal; the statistic's bits
    equal those of the same temperature as a tensor (div_rn per logit)."""
    from megatron_iso.ops.logprob.entropy import row_entropy

    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(64, 151936, device="cuda", generator=g) * 4).bfloat16()
    for t in (0.7, 1.3):
        number = row_entropy(x, temperature=t, leaves=8)
        tensor = row_entropy(x, temperature=torch.full((64, 1), t, device="cuda"), leaves=8)
        assert same_bits(number, tensor), t


def test_entropy_minus_inf_logits_add_nothing():
    """-inf logits (a lane's first entry, a whole leaf) add nothing to the statistic, as in fp64."""
    from megatron_iso.ops.logprob.entropy import entropy_from_partials, entropy_partials_reference, row_entropy

    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(8, 151936, device="cuda", generator=g) * 4).bfloat16()
    x[0, 5] = float("-inf")
    x[1, 151936 // 8 : 151936 // 4] = float("-inf")
    t = torch.full((8,), 0.7, device="cuda")
    ent = row_entropy(x, temperature=t.unsqueeze(-1), leaves=8)
    ref = entropy_from_partials(entropy_partials_reference(x, t, 8, 151936, 0))
    assert bool(torch.isfinite(ent).all()) and (ent.double() - ref.double()).abs().max() < 1e-4
