"""Vocab log-softmax family (CPU reference): bitwise batch and vocab-TP invariance, accuracy, native baseline."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.ops.logprob import (
    entropy_native,
    entropy_shards,
    log_softmax_shards,
    scale_logits,
    token_logprobs_native,
    token_logprobs_shards,
)
from megatron_iso.parallel.vocab_scoring import entropy, log_softmax, token_logprobs, token_logprobs_and_entropy
from megatron_iso.registry import lookup
from megatron_iso.testing.bits import same_bits

DTYPES = [torch.float32, torch.bfloat16]
M_SIZES = [1, 2, 3, 7, 8, 64]
V = 512


def make(m: int, v: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, v, generator=g) * 4).to(dtype), torch.randint(0, v, (m,), generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batch_invariance(dtype: torch.dtype, temperature: float) -> None:
    logits, targets = make(64, V, dtype)
    lp, ent = token_logprobs_and_entropy(logits, targets, temperature=temperature)
    assert lp.dtype == torch.float32 and lp.shape == (64,)
    assert same_bits(lp, token_logprobs(logits, targets, temperature=temperature))
    assert same_bits(ent, entropy(logits, temperature=temperature))
    for m in M_SIZES:
        assert same_bits(token_logprobs(logits[:m], targets[:m], temperature=temperature), lp[:m]), f"M={m}"
        assert same_bits(entropy(logits[-m:], temperature=temperature), ent[-m:]), f"M={m}"
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    assert same_bits(token_logprobs(logits[perm], targets[perm], temperature=temperature), lp[perm])
    # [batch, seq, V] is just rows.
    assert same_bits(token_logprobs(logits.view(8, 8, V), targets.view(8, 8), temperature=temperature), lp.view(8, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_tp_invariance_simulated(dtype: torch.dtype) -> None:
    logits, targets = make(7, V, dtype)
    lp = token_logprobs(logits, targets, temperature=0.9)
    ent = entropy(logits, temperature=0.9)
    full = log_softmax(logits, temperature=0.9)
    for c in (1, 2, 4, 8):
        shards = list(logits.chunk(c, dim=-1))
        assert same_bits(token_logprobs_shards(shards, targets, temperature=0.9), lp), f"TP={c}"
        assert same_bits(entropy_shards(shards, temperature=0.9), ent), f"TP={c}"
        assert same_bits(log_softmax_shards(shards, temperature=0.9), full), f"TP={c}"


def test_negative_zero_target_is_exact() -> None:
    logits = torch.zeros(2, 64)
    logits[0, 40] = -0.0
    logits[1, 3] = 5.0
    targets = torch.tensor([40, 3])
    ref = token_logprobs(logits, targets)
    for c in (2, 4, 8):
        assert same_bits(token_logprobs_shards(list(logits.chunk(c, -1)), targets), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_vs_float64(dtype: torch.dtype) -> None:
    logits, targets = make(16, 4096, dtype)
    z = logits.double() / 0.8
    exact = torch.log_softmax(z, -1)
    lp = token_logprobs(logits, targets, temperature=0.8)
    assert (lp.double() - exact.gather(-1, targets[:, None]).squeeze(-1)).abs().max() < 1e-5
    ent_exact = -(exact.exp() * exact).sum(-1)
    assert (entropy(logits, temperature=0.8).double() - ent_exact).abs().max() < 1e-5


def test_padding_mask() -> None:
    logits, targets = make(4, 64, torch.float32)
    targets = targets % 50
    lp = token_logprobs(logits, targets, valid_vocab=50)
    exact = torch.log_softmax(logits[:, :50].double(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (lp.double() - exact).abs().max() < 1e-5
    assert torch.isneginf(log_softmax(logits, valid_vocab=50)[:, 50:]).all()
    assert torch.isfinite(entropy(logits, valid_vocab=50)).all()
    for c in (2, 4):
        assert same_bits(token_logprobs_shards(list(logits.chunk(c, -1)), targets, valid_vocab=50), lp)


def test_temperature_tensor_and_scaling() -> None:
    logits, targets = make(4, 64, torch.bfloat16)
    t = torch.tensor([[0.5], [1.0], [0.7], [1.3]])
    lp = token_logprobs(logits, targets, temperature=t)
    for i in range(4):
        one = token_logprobs(logits[i : i + 1], targets[i : i + 1], temperature=float(t[i]))
        assert same_bits(lp[i : i + 1], one)
    assert same_bits(scale_logits(logits, 0.7), logits.float() / torch.tensor(0.7, dtype=torch.float32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"leaves": 6}, "leaves=6"),
        ({"leaves": 128}, "K=96"),  # vocab 96 not divisible by 128 leaves
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    logits, targets = make(2, 96, torch.float32)
    with pytest.raises(ValueError, match=message):
        token_logprobs(logits, targets, **kwargs)


def test_bad_target_and_dtype() -> None:
    logits, _ = make(2, 64, torch.float32)
    with pytest.raises(ValueError, match="target id"):
        token_logprobs(logits, torch.tensor([0, 64]))
    with pytest.raises(TypeError, match="float64"):
        token_logprobs(logits.double(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="TP degree 16"):
        token_logprobs_shards(list(logits.chunk(16, -1)), torch.tensor([0, 1]))


def test_temperature_checks_and_host_checked_tensors() -> None:
    """The range check runs on the fp32-rounded temperature; a Python number is checked on the
    host, a device tensor is read back once, and a tensor marked by ``host_checked_temperature``
    (values checked on the host before the upload) is not read at all. Same bits every way."""
    from megatron_iso.ops.logprob import host_checked_temperature
    from megatron_iso.testing.host_reads import HostReadCounter

    logits, _ = make(3, 64, torch.float32)
    for bad in (1e-50, 1e39, float("nan"), -1.0, torch.tensor([[1.0], [0.0], [2.0]]), torch.tensor(1e39).double()):
        with pytest.raises(ValueError, match="finite and > 0"):
            scale_logits(logits, bad)
    host = torch.tensor([[0.5], [1.0], [1.7]])
    with pytest.raises(ValueError, match="finite and > 0"):
        host_checked_temperature(host.clone(), torch.tensor([[0.5], [float("inf")], [1.0]]))
    with pytest.raises(ValueError, match="CPU tensor of t's shape"):
        host_checked_temperature(host.clone(), host[:2])
    reads = []
    with HostReadCounter() as c:
        c.seed(logits)
        for marked in (False, True):
            t = host.to("cpu", non_blocking=True)  # the device copy
            if marked:
                host_checked_temperature(t, host)
            c.clear()
            out = scale_logits(logits, t)
            reads.append(len(c.reads))
            assert same_bits(out, logits / host)
        c.clear()
        scale_logits(logits, 0.7)
        reads.append(len(c.reads))
    assert reads == [1, 0, 0], reads


def test_backward_matches_softmax_minus_onehot() -> None:
    logits, targets = make(5, 64, torch.float32)
    grads = []
    for _ in range(2):
        x = logits.clone().requires_grad_()
        token_logprobs(x, targets, temperature=0.5).sum().backward()
        grads.append(x.grad)
    assert same_bits(grads[0], grads[1])
    expected = (torch.nn.functional.one_hot(targets, 64) - torch.softmax(logits.double() / 0.5, -1)) / 0.5
    torch.testing.assert_close(grads[0].double(), expected, rtol=1e-5, atol=1e-6)


def test_registry_and_performance_profile() -> None:
    logits, targets = make(3, 64, torch.float32)
    assert lookup("logprob", "cpu", "correctness").ref == "vocab_logprob.reference@1"
    assert len(lookup("logprob", "cpu", "correctness").probe()) == 6
    assert same_bits(token_logprobs(logits, targets, profile="performance"), token_logprobs_native(logits, targets))
    assert same_bits(entropy(logits, profile="performance"), entropy_native(logits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_path_differs(dtype: torch.dtype) -> None:
    """Native batch and vocab-TP differences (printed; docs/INVARIANCE_CPU.md). On the CPUs measured,
    torch.log_softmax is batch invariant; a stock vocab-parallel log-sum-exp (per-shard sums added in
    rank order) is not TP invariant, and the leaf tree differs from the native numbers."""
    logits, targets = make(64, 32768, dtype)
    full = token_logprobs_native(logits, targets)
    batch = {m: (token_logprobs_native(logits[:m], targets[:m]) - full[:m]).abs().max().item() for m in M_SIZES}
    z = logits.float()
    m = z.amax(-1, keepdim=True)
    tp = {}
    for c in (2, 4, 8):
        s = torch.exp(z.chunk(c, -1)[0] - m).sum(-1)
        for zi in z.chunk(c, -1)[1:]:
            s = s + torch.exp(zi - m).sum(-1)
        lp = z.gather(-1, targets[:, None]).squeeze(-1) - (m.squeeze(-1) + torch.log(s))
        tp[c] = (lp - full).abs().max().item()
    ref = token_logprobs(logits, targets)
    print(
        f"\nnative logprob {dtype} V=32768: max|diff| by M {batch}; by TP {tp}; reference vs native {(ref - full).abs().max().item():.3e}"
    )
    assert any(d > 0 for d in tp.values())
    assert not same_bits(ref, full)


def test_cuda_contract_names_what_scoring_runs():
    """Scoring on CUDA runs the Triton leaf-sum kernel (``TritonScores``); the CPU keeps the torch reference. The
    registry, hence the contract, says so wherever triton is installed (CI)."""
    from megatron_iso.contract import load_op_implementations
    from megatron_iso.ops import logprob
    from megatron_iso.ops.logprob import logprob_triton
    from megatron_iso.registry import lookup

    load_op_implementations()
    impl = lookup("logprob", "cuda", "correctness")
    assert impl.ref == "vocab_logprob.triton@3"
    assert impl.fn is logprob_triton._triton_scores
    assert lookup("logprob", "cpu", "correctness").fn is logprob._reference_scores


def test_scoring_runs_the_registered_implementation() -> None:
    """A registry swap (what iso-gate does with a candidate kernel) reaches trainer/rollout scoring."""
    import dataclasses

    from megatron_iso.ops.logprob import VocabScores
    from megatron_iso.registry import swapped

    seen = []

    def candidate(logits, comm, *, temperature, leaves, valid_vocab):
        seen.append((tuple(logits.shape), leaves))
        return VocabScores(logits, comm, temperature=temperature, leaves=leaves, valid_vocab=valid_vocab)

    logits, ids = torch.randn(5, 64), torch.randint(0, 64, (5,))
    before = token_logprobs(logits, ids)
    with swapped(dataclasses.replace(lookup("logprob", "cpu", "correctness"), fn=candidate)):
        during = token_logprobs(logits, ids)
    assert len(seen) == 1 and seen[0][0][-1] == 64
    assert torch.equal(during.view(torch.int32), before.view(torch.int32))
    token_logprobs(logits, ids)
    assert len(seen) == 1  # the incumbent is back


def test_target_range_check_and_its_skip() -> None:
    """Out-of-vocab targets are refused by name; ``ids_in_range`` (the rollout's own samples) skips only
    the check (a host read on a GPU): the same bits for ids that are in range."""
    import pytest

    from megatron_iso.parallel.vocab_scoring import token_logprobs

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 64, generator=g)
    ids = torch.tensor([0, 63, 17, 5])
    with pytest.raises(ValueError, match="target id outside"):
        token_logprobs(logits, torch.tensor([0, 64, 1, 2]))
    checked = token_logprobs(logits, ids)
    trusted = token_logprobs(logits, ids, ids_in_range=True)
    assert torch.equal(checked.view(torch.int32), trusted.view(torch.int32))


def test_a_number_temperature_is_the_fp32_rounding_of_it() -> None:
    """A Python-number temperature is made on the device by a fill (no blocking host copy); its value is the fp32
    rounding of the number, as ``torch.as_tensor`` gives, and a bad one is refused before anything runs."""
    from megatron_iso.ops.logprob.reference import checked_temperature

    for t in (0.7, 1.3, 1e-3, 3, 0.1, 1 + 2**-30):
        got = checked_temperature(t, torch.device("cpu"))
        want = torch.as_tensor(t, dtype=torch.float32)
        assert got.shape == () and torch.equal(got.view(torch.int32), want.view(torch.int32)), t
    for bad in (0.0, -1.0, float("inf"), 1e-50):  # 1e-50 rounds to 0 in fp32
        with pytest.raises(ValueError, match="finite and > 0"):
            checked_temperature(bad, torch.device("cpu"))
