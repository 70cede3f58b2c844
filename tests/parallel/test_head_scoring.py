"""The LM head scored in row chunks (parallel.head_scoring): the same logprob bits as the unchunked head
and scoring, gradients equal to the unchunked backward up to the order of the weight gradient's sum,
the same bits on a second run; at TP 2 with SP the chunked logprobs equal TP 1's."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import same_bits
from megatron_iso.testing.harness import run_on_ranks

SEQS = [(0, 150), (1, 90), (2, 7)]  # 247 rows: two 128-row chunks at the smallest chunk size


def _score_both(overrides: list[str], chunk_elements: int):
    from megatron.core import parallel_state

    from megatron_iso.models.batch import pack
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.scoring import _scoring_kwargs, score_sequences
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.parallel import head_scoring
    from megatron_iso.parallel.vocab_scoring import token_logprobs
    from megatron_iso.settings.compose import load_config

    head_scoring.CHUNK_ELEMENTS = chunk_elements
    tc = transformer_config(load_config(overrides))
    model = build_model(tc, random_hf_state_dict(tc, seed=11))
    seqs = [torch.randint(0, tc.vocab_size, (n,), generator=torch.Generator().manual_seed(s)) for s, n in SEQS]
    ids, batch = pack(seqs, pad_to_multiple=tc.tensor_model_parallel_size if tc.sequence_parallel else 1)
    upstream = torch.randn(ids.shape[1], generator=torch.Generator().manual_seed(5))

    def grads_of(logp: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (logp * upstream).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    chunked, ent = score_sequences(model, ids, batch)
    chunked_grads = grads_of(chunked)
    again = grads_of(score_sequences(model, ids, batch, with_entropy=False)[0])
    # The unchunked reference: the whole batch's logits, then the scoring function.
    logits = model.forward_packed(ids, batch)
    whole = token_logprobs(logits, torch.roll(ids.reshape(-1), -1), **_scoring_kwargs(tc, 1.0))
    last = batch.cu_seqlens_q[1:].long() - 1
    whole = whole.masked_fill(torch.isin(torch.arange(whole.numel()), last), 0.0)
    whole_grads = grads_of(whole)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return {"chunked": chunked.detach(), "ent": ent, "whole": whole.detach(), "grads": chunked_grads,
            "again": again, "whole_grads": whole_grads, "rank": rank}  # fmt: skip


@pytest.mark.parametrize("chunk_elements", [1, 1 << 28])  # 128-row chunks (several); one chunk
def test_chunked_head_matches_the_whole_batch(chunk_elements):
    base = ["model=tiny_dense"]
    out = run_on_ranks(_score_both, 1, args=(base, chunk_elements))[0]
    assert same_bits(out["chunked"], out["whole"])
    assert out["ent"] is not None and bool(torch.isfinite(out["ent"]).all())
    assert out["grads"].keys() == out["whole_grads"].keys() and "output_layer.weight" in out["grads"]
    for name, g in out["grads"].items():
        assert same_bits(g, out["again"][name]), f"{name}: a second run gave other bits"
        ref = out["whole_grads"][name]
        assert float((g - ref).abs().max()) <= 1e-6 * max(float(ref.abs().max()), 1.0), name


def test_performance_profile_scores_in_chunks():
    """The stock baseline chunks too (library GEMM and torch's log-softmax per chunk, no whole-batch logits): the
    same scores as its whole-batch call up to the library's rounding, and the same gradients up to their order."""
    out = run_on_ranks(_score_both, 1, args=(["model=tiny_dense", "profile=performance"], 1))[0]
    assert float((out["chunked"] - out["whole"]).abs().max()) <= 1e-5
    assert out["ent"] is not None and bool(torch.isfinite(out["ent"]).all())
    for name, g in out["grads"].items():
        ref = out["whole_grads"][name]
        assert float((g - ref).abs().max()) <= 1e-5 * max(float(ref.abs().max()), 1.0), name


def test_chunked_head_at_tp2_sp_equals_tp1():
    base = ["model=tiny_dense"]
    ref = run_on_ranks(_score_both, 1, args=(base, 1))[0]
    got = run_on_ranks(_score_both, 2, tp=2, args=([*base, "parallel.tp=2", "parallel.sp=true"], 1))
    for r in got:
        assert same_bits(r["chunked"][: ref["chunked"].numel()], ref["chunked"])
        assert same_bits(r["chunked"], r["whole"])


def _score_rows(overrides: list[str]):
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.scoring import score_sequences
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    tc = transformer_config(load_config(overrides))
    model = build_model(tc, random_hf_state_dict(tc, seed=11))
    seqs = [torch.randint(0, tc.vocab_size, (n,), generator=torch.Generator().manual_seed(s)) for s, n in SEQS]
    ids, batch = pack(seqs)
    rows = torch.tensor([3, 4, 5, 160, 161, 200, 238])
    temps = torch.linspace(0.5, 1.5, ids.shape[1]).unsqueeze(-1)
    with torch.no_grad():
        full, full_ent = score_sequences(model, ids, batch, temperature=temps)
    part, part_ent = score_sequences(model, ids, batch, temperature=temps, rows=rows)
    part.sum().backward()
    others = torch.ones(ids.shape[1], dtype=torch.bool)
    others[rows] = False
    return {"full": full, "part": part.detach(), "full_ent": full_ent, "part_ent": part_ent, "rows": rows,
            "others": others, "head_grad": model.output_layer.weight.grad}  # fmt: skip


@pytest.mark.parametrize("profile", ["correctness", "performance"])
def test_scoring_some_rows_gives_those_rows_bits(profile):
    out = run_on_ranks(_score_rows, 1, args=(["model=tiny_dense", f"profile={profile}"],))[0]
    rows = out["rows"]
    assert same_bits(out["part"][rows], out["full"][rows]) and same_bits(out["part_ent"][rows], out["full_ent"][rows])
    assert bool((out["part"][out["others"]] == 0).all()) and bool((out["part_ent"][out["others"]] == 0).all())
    assert out["head_grad"] is not None and bool(out["head_grad"].abs().sum() > 0)
