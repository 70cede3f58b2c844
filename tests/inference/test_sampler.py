"""Sampler pieces (no model): Philox known answers, batch-independent draws and selection,
filter semantics, parameter errors, paged KV block bookkeeping."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.inference.kv_blocks import PagedKVCache
from megatron_iso.inference.params import SamplingParams
from megatron_iso.inference.rng import philox4x32, request_key, uniforms
from megatron_iso.inference.sampler import inclusive_scan, select_tokens


def _w(*xs: int) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.int64)


@pytest.mark.parametrize(
    ("ctr", "key", "expected"),
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(ctr, key, expected):
    # Random123's published philox4x32-10 known-answer vectors.
    assert philox4x32(_w(*ctr), _w(*key))[0].tolist() == list(expected)


def test_uniforms_are_pure_functions_of_their_key():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 1 << 62, (50,), generator=g)
    reqs = torch.randint(-(1 << 62), 1 << 62, (50,), generator=g)
    samples, pos = torch.randint(0, 8, (50,), generator=g), torch.randint(0, 4096, (50,), generator=g)
    batch = uniforms(seeds, reqs, samples, pos)
    alone = torch.cat(
        [uniforms(seeds[i : i + 1], reqs[i : i + 1], samples[i : i + 1], pos[i : i + 1]) for i in range(50)]
    )
    assert torch.equal(batch.view(torch.int32), alone.view(torch.int32))
    assert bool(((batch >= 0) & (batch < 1)).all())
    # Any field of the key changes the draw.
    base = uniforms(seeds[:1], reqs[:1], samples[:1], pos[:1])
    for changed in (
        uniforms(seeds[:1] + 1, reqs[:1], samples[:1], pos[:1]),
        uniforms(seeds[:1], reqs[:1] + 1, samples[:1], pos[:1]),
        uniforms(seeds[:1], reqs[:1], samples[:1] + 1, pos[:1]),
        uniforms(seeds[:1], reqs[:1], samples[:1], pos[:1] + 1),
    ):
        assert not torch.equal(base, changed)
    u = uniforms(
        torch.zeros(20000, dtype=torch.int64),
        torch.zeros(20000, dtype=torch.int64),
        torch.zeros(20000, dtype=torch.int64),
        torch.arange(20000),
    )
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_request_key():
    assert request_key(5) == 5
    assert request_key("grpo-7") == request_key("grpo-7") != request_key("grpo-8")
    with pytest.raises(ValueError, match="request_id"):
        request_key(-1)


def test_inclusive_scan_matches_exact_sums():
    x = torch.randint(0, 100, (3, 37)).float()  # small integers: every order gives the exact sum
    assert torch.equal(inclusive_scan(x), torch.cumsum(x, -1))


def test_inclusive_scan_is_hillis_steele_bit_for_bit():
    """The two-buffer scan performs the additions of the plain Hillis-Steele rounds (clone, shifted
    add): same bits on random floats, where any other order would differ."""

    def plain(x: torch.Tensor) -> torch.Tensor:
        out, shift = x.clone(), 1
        while shift < out.shape[-1]:
            nxt = out.clone()
            nxt[..., shift:] = out[..., shift:] + out[..., :-shift]
            out, shift = nxt, shift * 2
        return out

    g = torch.Generator().manual_seed(3)
    for shape in ((4, 1), (3, 2), (5, 37), (2, 1000), (1, 4099)):
        x = torch.rand(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4)
        got, want = inclusive_scan(x), plain(x)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), shape
    x = torch.rand(2, 5000, generator=g)
    assert not torch.equal(plain(x), torch.cumsum(x, -1))  # the check above can tell orders apart


def _logp(rows: int, vocab: int, seed: int) -> torch.Tensor:
    z = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    return torch.log_softmax(z, -1)


def _select(logp, u, *, greedy=False, top_k=0, top_p=1.0):
    r = logp.shape[0]
    return select_tokens(
        logp,
        u,
        greedy=torch.full((r,), greedy),
        top_k=torch.full((r,), top_k),
        top_p=torch.full((r,), top_p, dtype=torch.float32),
    )


def test_selection_is_batch_invariant():
    logp = _logp(16, 301, 1)
    u = torch.rand(16, generator=torch.Generator().manual_seed(2))
    kw = {"top_k": 40, "top_p": 0.8}
    full = _select(logp, u, **kw)
    alone = torch.cat([_select(logp[i : i + 1], u[i : i + 1], **kw) for i in range(16)])
    assert torch.equal(full, alone)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_select(logp[perm], u[perm], **kw), full[perm])


def test_filters():
    logp = _logp(64, 50, 4)
    u = torch.rand(64, generator=torch.Generator().manual_seed(5))
    argmax = logp.argmax(-1)
    assert torch.equal(_select(logp, u, greedy=True), argmax)
    assert torch.equal(_select(logp, u, top_k=1), argmax)
    assert torch.equal(_select(logp, u, top_p=1e-6), argmax)
    top3 = logp.topk(3, -1).indices
    picked = _select(logp, u, top_k=3)
    assert bool((top3 == picked.unsqueeze(-1)).any(-1).all())
    # Ties go to the lowest token id.
    flat = torch.full((1, 10), -float(torch.log(torch.tensor(10.0))))
    assert _select(flat, torch.zeros(1), greedy=True).item() == 0


def test_sampling_follows_the_distribution():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    n = 20000
    u = uniforms(
        torch.zeros(n, dtype=torch.int64),
        torch.ones(n, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n),
    )
    tok = _select(p.log().expand(n, 4).contiguous(), u)
    freq = torch.bincount(tok, minlength=4).float() / n
    assert torch.allclose(freq, p[0], atol=0.015), freq


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_new_tokens", 0),
        ("n", 0),
        ("seed", -1),
        ("stop_token_ids", (999,)),
        ("top_logprobs", 1000),
    ],
)
def test_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value}).validate(vocab_size=256)


def test_paged_blocks_share_copy_on_write_and_return():
    c = PagedKVCache([0], num_blocks=8, block_size=4, kv_heads=1, head_dim=2, dtype=torch.float32)
    prompt = list(range(10))
    c.admit(0, prompt, 0)
    c.prepare_append(0, 0, 10)  # 3 blocks, the last one partial
    c.k[0][c.tables[0][2]] = 7.0
    c.commit_prefix(0, prompt)
    c.fork(0, 1)
    c.fork(0, 2)
    c.release(0)
    assert c.tables[1] == c.tables[2] and c.refcount[c.tables[1][2]] == 2
    c.prepare_append(1, 10, 1)  # writes into the shared partial block: sample 1 gets a copy
    assert c.tables[1][:2] == c.tables[2][:2] and c.tables[1][2] != c.tables[2][2]
    assert torch.equal(c.k[0][c.tables[1][2]], c.k[0][c.tables[2][2]])
    assert c.remaining(2, 16) == 1  # now sole owner of the old partial block: one more block to 16
    c.release(1)
    c.release(2)
    assert c.free_units() == 8 and c.cached_blocks == 2  # two full prompt blocks kept for reuse
    assert c.match_prefix(prompt) == 8 and c.match_prefix([0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4
    c.flush()
    assert c.cached_blocks == 0 and c.match_prefix(prompt) == 0 and c.free_units() == 8
    c.admit(3, prompt, 0)
    with pytest.raises(RuntimeError, match="running sequences"):
        c.flush()


def test_uniforms_pinned_values() -> None:
    """The (seed, request, sample, position) -> uniform map itself, pinned: a change of word layout or
    arithmetic (e.g. the numpy rewrite of the torch int64 version) would change every rollout."""
    u = uniforms(
        torch.tensor([0, 2024, -7]), torch.tensor([101, 2**62 + 5, -(2**40)]), torch.tensor([0, 3, 1]),
        torch.tensor([5, 4095, 0]),
    )  # fmt: skip
    assert u.dtype == torch.float32
    assert u.view(torch.int32).tolist() == [1062181211, 1055860336, 1064016367]
