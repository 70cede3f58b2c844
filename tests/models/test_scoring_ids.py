"""Target ids of the scoring checked once, on the host, where the batch is packed (``pack(vocab_size=...)``): a bad id
is named there; scoring a batch so checked reads no id back (on a GPU: no sync per LM-head chunk) and gives the bits
of the checking path; an unchecked batch keeps the scoring function's own check."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.models.batch import pack
from megatron_iso.testing.bits import same_bits
from megatron_iso.testing.harness import run_on_ranks

SEQS = [(0, 150), (1, 90), (2, 7)]  # 247 rows: two 128-row chunks at the smallest chunk size
RANGE_CHECK = "megatron_iso/ops/logprob/reference.py"  # VocabScores.token_logprobs' check: an item() per chunk


@pytest.mark.parametrize(
    ("seqs", "pattern"),
    [
        ([[1, 2, 3], [4, 5, 256]], r"^pack: sequence 1 holds token id 256 at position 2, outside the model's vocab "),
        ([torch.tensor([7, -1]), torch.tensor([3])], r"^pack: sequence 0 holds token id -1 at position 1, outside "),
        ([[5], [300, 1]], r"sequence 1 holds token id 300 at position 0, .*\[0, 256\) \(model\.vocab_size=256\)$"),
    ],
)
def test_pack_names_a_token_id_outside_the_vocab(seqs, pattern):
    with pytest.raises(ValueError, match=pattern):
        pack(seqs, vocab_size=256)
    _, batch = pack(seqs)  # unchecked: the scoring checks
    assert batch.ids_checked_below is None
    _, batch = pack([[0, 1], [255]], vocab_size=256, pad_to_multiple=4)  # the filler (token 0) is in the vocab
    assert batch.ids_checked_below == 256


def _score(checked_below: int | None) -> dict:
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.scoring import score_sequences
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.parallel import head_scoring
    from megatron_iso.settings.compose import load_config
    from megatron_iso.testing.host_reads import HostReadCounter

    head_scoring.CHUNK_ELEMENTS = 1  # 128-row chunks: two
    tc = transformer_config(load_config(["model=tiny_dense"]))
    model = build_model(tc, random_hf_state_dict(tc, seed=11))
    seqs = [torch.randint(0, tc.vocab_size, (n,), generator=torch.Generator().manual_seed(s)) for s, n in SEQS]
    with HostReadCounter() as counter:
        counter.seed(model)
        ids, batch = pack(seqs, device="cpu", vocab_size=checked_below)  # an explicit device: a device batch
        logp, _ = score_sequences(model, ids, batch, with_entropy=False)
        logp.sum().backward()
        reads = sum(n for (_, where), n in counter.summary().items() if where.startswith(RANGE_CHECK))
    return {"logp": logp.detach(), "range_reads": reads}


def test_a_checked_batch_is_scored_without_reading_its_ids():
    unchecked, checked, larger = (run_on_ranks(_score, 1, args=(c,))[0] for c in (None, 256, 512))
    assert unchecked["range_reads"] == 2  # one per LM-head chunk
    assert checked["range_reads"] == 0
    assert larger["range_reads"] == 2  # checked against a larger vocab than the model's: checked again
    assert same_bits(checked["logp"], unchecked["logp"])
