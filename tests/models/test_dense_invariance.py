"""Dense model (iso profile): logprobs identical across TP 1/2/4, SP on/off, batch packing, and
between a training forward and prefill + decode. The native profile's gaps are measured."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

PROMPTS = [(0, 11), (1, 5), (2, 19), (3, 2)]  # (seed, length) of random token sequences


def _setup(overrides: list[str]):
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    cfg = load_config(overrides)
    tc = transformer_config(cfg)
    model = build_model(tc, random_hf_state_dict(tc, seed=7)).eval()
    return tc, model


def _sequences(vocab: int, order: list[int]) -> list[torch.Tensor]:
    out = []
    for i in order:
        seed, n = PROMPTS[i]
        out.append(torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)))
    return out


def _score(overrides: list[str], order: list[int]):
    """Per-sequence logprobs and entropies of a teacher-forced forward, in PROMPTS order."""
    from megatron_iso.models.batch import pack
    from megatron_iso.models.scoring import score_sequences

    tc, model = _setup(overrides)
    seqs = _sequences(tc.vocab_size, order)
    ids, batch = pack(seqs, pad_to_multiple=tc.tensor_model_parallel_size if tc.sequence_parallel else 1)
    with torch.no_grad():
        logp, ent = score_sequences(model, ids, batch)
    cu = batch.cu_seqlens_q.tolist()
    per_seq = {i: (logp[cu[j] : cu[j + 1]], ent[cu[j] : cu[j + 1]]) for j, i in enumerate(order)}
    return [per_seq[i] for i in sorted(per_seq)]


def _equal(a, b) -> bool:
    return all(
        torch.equal(bits(x), bits(y)) for (xl, xe), (yl, ye) in zip(a, b, strict=True) for x, y in ((xl, yl), (xe, ye))
    )


def _max_diff(a, b) -> float:
    return max(float((x[0] - y[0]).abs().max()) for x, y in zip(a, b, strict=True))


ALL = [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_iso_logprobs_identical_across_tp_and_sp(dtype):
    base = [f"model.params_dtype={dtype}"]
    ref = run_on_ranks(_score, 1, args=(base, ALL))[0]
    for tp, sp in ((2, False), (2, True), (4, True)):
        got = run_on_ranks(_score, tp, tp=tp, args=([*base, f"parallel.tp={tp}", f"parallel.sp={sp}"], ALL))
        for rank_result in got:
            assert _equal(ref, rank_result), f"TP={tp} SP={sp} {dtype}: max |dlogp| {_max_diff(ref, rank_result):.3e}"


def test_iso_logprobs_independent_of_batch_composition():
    def run(order):
        return run_on_ranks(_score, 1, args=([], order))[0]

    full = run(ALL)
    alone = [run([i])[0] for i in ALL]
    assert _equal(full, alone)
    assert _equal(full, run([3, 1, 0, 2]))


def _native_gaps() -> dict[str, float]:
    base = ["profile=performance"]
    ref = run_on_ranks(_score, 1, args=(base, ALL))[0]
    out = {}
    for tp in (2, 4):
        got = run_on_ranks(_score, tp, tp=tp, args=([*base, f"parallel.tp={tp}"], ALL))[0]
        out[f"tp{tp}"] = _max_diff(ref, got)
    return out


def test_native_profile_differs_across_tp():
    gaps = _native_gaps()
    print(f"native profile max |dlogp| vs TP=1 (fp32, tiny_dense): {gaps}")
    # Stock row-parallel all-reduce sums rank partials in another order: the last bits move.
    assert max(gaps.values()) > 0.0


def _prefill_decode(overrides: list[str], prompt_len: int, chunks: list[int]):
    """Logits for one sequence: training forward vs chunked prefill then token-by-token decode."""
    from megatron_iso.models.batch import pack
    from megatron_iso.ops.attention.kv_cache import KVCache

    tc, model = _setup(overrides)
    seq = torch.randint(0, tc.vocab_size, (prompt_len + 6,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ids, batch = pack([seq])
        full = model.forward_packed(ids, batch)
        tp = tc.tensor_model_parallel_size
        cache = KVCache.allocate(tc.num_layers, 2, 64, tc.num_query_groups // tp, tc.kv_channels, dtype=tc.params_dtype)
        pieces, pos = [], 0
        for n in [*chunks, *([1] * (len(seq) - sum(chunks)))]:
            case = "decode" if n == 1 and pos >= prompt_len else "prefill"
            ids, batch = pack([seq[pos : pos + n]], start_positions=[pos], case=case, kv_cache=cache, slots=[1])
            pieces.append(model.forward_packed(ids, batch))
            cache.advance([1], [n])
            pos += n
    return full, torch.cat(pieces)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("prompt_len", "chunks"), [(9, [9]), (13, [5, 8]), (1, [1])])
def test_iso_prefill_and_decode_equal_training_forward(dtype, prompt_len, chunks):
    full, cached = run_on_ranks(_prefill_decode, 1, args=([f"model.params_dtype={dtype}"], prompt_len, chunks))[0]
    assert full.shape == cached.shape
    assert torch.equal(bits(full), bits(cached)), f"max |dlogit| {(full.float() - cached.float()).abs().max():.3e}"


def test_iso_prefill_decode_equal_training_forward_at_tp2():
    full, cached = run_on_ranks(_prefill_decode, 2, tp=2, args=(["parallel.tp=2"], 9, [4, 5]))[0]
    assert torch.equal(bits(full), bits(cached))


def test_native_prefill_decode_gap_is_measured():
    full, cached = run_on_ranks(_prefill_decode, 1, args=(["profile=performance"], 9, [9]))[0]
    gap = float((full - cached).abs().max())
    print(f"native profile training-forward vs prefill+decode max |dlogit| (fp32): {gap:.3e}")
    assert gap >= 0.0 and torch.isfinite(cached).all()
