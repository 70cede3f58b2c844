"""The Gumbel-max sampler: the Triton kernel (under TRITON_INTERPRET=1) against the float64 torch reference bit
for bit; the draw is a pure function of (row key, logits); greedy and tie rules; and that it samples
softmax(logits / T) (a chi-square test over many keys)."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from megatron_iso.inference.rng import row_keys
from megatron_iso.inference.sampler import gumbel_partials_reference, gumbel_tokens


def _keys(n: int, seed: int = 3) -> torch.Tensor:
    ar = torch.arange(n)
    return row_keys(torch.full((n,), seed), ar * 7 + 1, ar % 3, ar + 11)


def _draw(logits, keys, temp=1.0, greedy=False, **kw):
    r = logits.shape[0]
    return gumbel_tokens(
        logits, keys, torch.full((r,), temp, dtype=torch.float32), torch.full((r,), greedy, dtype=torch.bool), **kw
    )


def test_row_keys_are_pure_functions_of_the_row():
    k = _keys(40)
    assert k.shape == (40, 2) and int(k.min()) >= 0 and int(k.max()) < 2**32
    alone = torch.cat([row_keys(torch.tensor([3]), torch.tensor([i * 7 + 1]), torch.tensor([i % 3]),
                                torch.tensor([i + 11])) for i in range(40)])  # fmt: skip
    assert torch.equal(alone, k)
    assert len({tuple(r) for r in k.tolist()}) == 40


def test_draw_is_batch_invariant_and_keyed():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(24, 300, generator=g) * 2).bfloat16()
    keys = _keys(24)
    full = _draw(logits, keys, 0.7)
    alone = torch.cat([_draw(logits[i : i + 1], keys[i : i + 1], 0.7) for i in range(24)])
    assert torch.equal(full, alone)
    perm = torch.randperm(24, generator=g)
    assert torch.equal(_draw(logits[perm], keys[perm], 0.7), full[perm])
    assert not torch.equal(_draw(logits, _keys(24, seed=4), 0.7), full)  # another key, other draws


def test_greedy_takes_the_lowest_id_among_maxima():
    logits = torch.zeros(3, 50)
    logits[0, [7, 9, 30]] = 5.0
    logits[1, 49] = 1.0
    assert _draw(logits, _keys(3), greedy=True).tolist() == [7, 49, 0]


def test_padding_ids_and_nan_rows():
    logits = torch.zeros(4, 64)
    logits[:, 60:] = 100.0  # padding ids >= valid_vocab: never drawn however likely
    logits[3] = float("nan")
    tok = _draw(logits, _keys(4), valid_vocab=60)
    assert int(tok[:3].max()) < 60
    assert int(tok[3]) == 0  # a row with no finite score gets token 0 (its logprob is NaN: the run sees it)


def test_draws_follow_softmax():
    """Many keys on one row of 8 tokens: the counts match softmax(logits / T) (chi-square, 7 dof, p ~ 1e-6)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.25]])
    n, temp = 40000, 0.8
    keys = row_keys(torch.zeros(n, dtype=torch.int64), torch.arange(n), torch.zeros(n, dtype=torch.int64),
                    torch.zeros(n, dtype=torch.int64))  # fmt: skip
    tok = _draw(logits.expand(n, -1), keys, temp)
    counts = torch.bincount(tok, minlength=8).double()
    p = torch.softmax(logits[0].double() / temp, -1)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 40.0, (chi2, counts.tolist())


def test_tp_shards_draw_the_full_vocab_token():
    """The vocab-parallel combine, on two gloo ranks: each scores its shard; the token is the one-rank token."""
    from megatron_iso.testing.harness import run_on_ranks

    run_on_ranks(_tp_worker, 2, tp=2)


def _tp_worker() -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(16, 256, generator=g) * 3
    keys = _keys(16)
    want = _draw(logits, keys, 1.3)
    shard = logits.chunk(world, dim=-1)[rank]
    got = _draw(shard, keys, 1.3, group=dist.group.WORLD)
    assert torch.equal(got, want)


pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()

    import torch
    from megatron_iso.inference import sampler_triton as st
    from megatron_iso.inference.rng import row_keys
    from megatron_iso.inference.sampler import gumbel_partials_reference as ref

    g = torch.Generator().manual_seed(2)
    rows, vocab = 6, 2600  # three tiles, the last one partial
    logits = (torch.randn(rows, vocab, generator=g) * 4).bfloat16()
    logits[2, 100:200] = 30.0  # a greedy row with a 100-way tie
    ar = torch.arange(rows)
    keys = row_keys(torch.full((rows,), 5), ar + 2**40, ar, ar * 3)
    temp = torch.tensor([1.0, 0.5, 1.0, 2.0, 0.9, 1.0])
    greedy = torch.tensor([False, False, True, False, False, True])
    for offset, valid in ((0, vocab), (4096, 4096 + 2500)):
        want_s, want_i = ref(logits, keys, temp, greedy, id_offset=offset, valid_vocab=valid)
        for splits in (1, 2, 3):
            s, i = st.gumbel_partials_triton(logits, keys, temp, greedy, id_offset=offset, valid_vocab=valid,
                                             splits=splits)
            got_s, at = s.max(-1, keepdim=True)
            got_i = i.gather(-1, at)
            assert torch.equal(got_s.view(torch.int64), want_s.view(torch.int64)), (offset, splits, got_s, want_s)
            assert torch.equal(got_i, want_i), (offset, splits, got_i, want_i)
    s, i = ref(logits, keys, temp, greedy, id_offset=0, valid_vocab=vocab)
    assert int(i[2]) == 100
    print("ok")
    """
)


def test_kernel_equals_reference_under_interpreter():
    from megatron_iso.testing.triton_interpret import run_interpreted

    res = run_interpreted(SCRIPT, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_noise_is_finite():
    """u is never 0 or 1: the noise of the extreme words is finite."""
    from megatron_iso.ops.common.ieee_math import log64

    for word in (0, 2**32 - 1):
        u = torch.tensor([((word >> 8) + 0.5) * 2.0**-24], dtype=torch.float64)
        assert math.isfinite(float(-log64(-log64(u))))


def test_reference_partials_shape():
    s, i = gumbel_partials_reference(
        torch.randn(3, 10), _keys(3), torch.ones(3), torch.zeros(3, dtype=torch.bool), id_offset=10, valid_vocab=20
    )
    assert s.shape == i.shape == (3, 1) and s.dtype == torch.float64 and int(i.min()) >= 10


def test_token_words_are_philox():
    """The torch int64 Philox of the per-token draws equals the numpy Philox-4x32-10 of ``rng``."""
    from megatron_iso.inference.rng import GUMBEL_STREAM, philox4x32, token_words

    keys = torch.tensor([[0, 0], [2**32 - 1, 2**32 - 1], [123456789, 987654321]])
    ids = torch.tensor([0, 1, 2**31, 2**32 - 1, 151935])
    got = token_words(keys, ids)
    counter = torch.stack([ids, torch.full_like(ids, GUMBEL_STREAM), torch.zeros_like(ids), torch.zeros_like(ids)], -1)
    want = torch.stack([philox4x32(counter, k.expand(len(ids), 2))[:, 0] for k in keys])
    assert torch.equal(got, want)
