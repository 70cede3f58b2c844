"""The Gumbel-max kernel on the GPU at Qwen3 vocab width: the CPU reference's scores and tokens bit for bit,
for any vocab split, at batch sizes 1 to 64 (batch invariance), greedy rows included."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.inference.rng import row_keys
from megatron_iso.inference.sampler import gumbel_partials_reference, gumbel_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")
from megatron_iso.inference.sampler_triton import gumbel_partials_triton  # noqa: E402

VOCAB = 151936


def _inputs(rows: int):
    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, VOCAB, generator=g) * 3).bfloat16()
    ar = torch.arange(rows)
    keys = row_keys(torch.full((rows,), 17), ar * 5 + 3, ar % 4, ar + 600)
    temp = torch.rand(rows, generator=g) + 0.5
    greedy = ar % 5 == 4
    return logits, keys, temp, greedy


@pytest.mark.parametrize("splits", [None, 1, 7])
def test_kernel_scores_equal_reference(splits):
    logits, keys, temp, greedy = _inputs(16)
    want_s, want_i = gumbel_partials_reference(logits, keys, temp, greedy, id_offset=0, valid_vocab=VOCAB)
    s, i = gumbel_partials_triton(logits.cuda(), keys.cuda(), temp.cuda(), greedy.cuda(), id_offset=0,
                                  valid_vocab=VOCAB, splits=splits)  # fmt: skip
    best, at = s.max(-1, keepdim=True)
    assert torch.equal(best.cpu().view(torch.int64), want_s.view(torch.int64))
    assert torch.equal(i.gather(-1, at).cpu(), want_i)


def test_tokens_batch_invariant_on_device():
    logits, keys, temp, greedy = _inputs(64)
    args = [t.cuda() for t in (logits, keys, temp, greedy)]
    full = gumbel_tokens(*args)
    for n in (1, 7, 33):
        assert torch.equal(gumbel_tokens(*[a[:n] for a in args]), full[:n])
    assert torch.equal(full.cpu(), gumbel_tokens(logits, keys, temp, greedy))
