"""Hybrid GDN model (tiny_hybrid, Qwen3-Next style): logprobs identical across TP 1/2 and batch
packing; training forward == prefill + decode bit for bit across GDN chunk boundaries; agreement with
HF transformers' Qwen3-Next on the same weights; deterministic backward; the native gap, measured."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

BASE = ["model=tiny_hybrid", "profile.gdn_chunk=8"]  # chunk 8: short sequences cross several chunks
PROMPTS = [(0, 11), (1, 5), (2, 19), (3, 2)]  # (seed, length)


def _setup(overrides: list[str]):
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    tc = transformer_config(load_config(overrides))
    return tc, build_model(tc, random_hf_state_dict(tc, seed=7)).eval()


def _sequences(vocab: int, order: list[int]) -> list[torch.Tensor]:
    return [
        torch.randint(0, vocab, (PROMPTS[i][1],), generator=torch.Generator().manual_seed(PROMPTS[i][0])) for i in order
    ]


def _score(overrides: list[str], order: list[int]):
    from megatron_iso.models.batch import pack
    from megatron_iso.models.scoring import score_sequences

    tc, model = _setup(overrides)
    ids, batch = pack(_sequences(tc.vocab_size, order))
    with torch.no_grad():
        logp, _ = score_sequences(model, ids, batch)
    cu = batch.cu_seqlens_q.tolist()
    per_seq = {i: logp[cu[j] : cu[j + 1]] for j, i in enumerate(order)}
    return [per_seq[i] for i in sorted(per_seq)]


def _equal(a, b) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


ALL = [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_iso_hybrid_logprobs_identical_tp1_tp2(dtype):
    over = [*BASE, f"model.params_dtype={dtype}"]
    ref = run_on_ranks(_score, 1, args=(over, ALL))[0]
    for rank_result in run_on_ranks(_score, 2, tp=2, args=([*over, "parallel.tp=2"], ALL)):
        assert _equal(ref, rank_result), f"TP=2 {dtype}: max |dlogp| {_max_diff(ref, rank_result):.3e}"


def test_iso_hybrid_batch_composition():
    full = run_on_ranks(_score, 1, args=(BASE, ALL))[0]
    assert _equal(full, run_on_ranks(_score, 1, args=(BASE, [3, 1, 0, 2]))[0])
    assert _equal([full[2]], run_on_ranks(_score, 1, args=(BASE, [2]))[0])


def _prefill_decode(overrides: list[str], prompt_len: int, pieces: list[int], decode: int = 10):
    """Logits of one sequence: training forward vs prefill ``pieces`` then ``decode`` 1-token steps."""
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gdn import allocate_gdn_cache
    from megatron_iso.ops.attention.kv_cache import KVCache

    tc, model = _setup(overrides)
    seq = torch.randint(0, tc.vocab_size, (prompt_len + decode,), generator=torch.Generator().manual_seed(3))
    tp = tc.tensor_model_parallel_size
    with torch.no_grad():
        full = model.forward_packed(*pack([seq]))
        kv = KVCache.allocate(tc.num_layers, 2, 128, tc.num_query_groups // tp, tc.kv_channels, dtype=tc.params_dtype)
        gdn = allocate_gdn_cache(tc, 2)
        out, pos = [], 0
        for n in [*pieces, *([1] * (len(seq) - sum(pieces)))]:
            case = "decode" if n == 1 and pos >= prompt_len else "prefill"
            ids, batch = pack(
                [seq[pos : pos + n]], start_positions=[pos], case=case, kv_cache=kv, gdn_cache=gdn, slots=[1]
            )
            out.append(model.forward_packed(ids, batch))
            kv.advance([1], [n])
            pos += n
    return full, torch.cat(out)


@pytest.mark.parametrize(("prompt_len", "pieces"), [(7, [7]), (8, [8]), (9, [9]), (19, [5, 8, 6]), (1, [1])])
def test_iso_hybrid_prefill_decode_equals_training_forward(prompt_len, pieces):
    full, cached = run_on_ranks(_prefill_decode, 1, args=(BASE, prompt_len, pieces))[0]
    assert torch.equal(bits(full), bits(cached)), f"max |dlogit| {(full - cached).abs().max():.3e}"


def test_iso_hybrid_prefill_decode_chunk64_and_tp2():
    full, cached = run_on_ranks(_prefill_decode, 1, args=(["model=tiny_hybrid"], 63, [63], 2))[0]
    assert torch.equal(bits(full), bits(cached))
    for full, cached in run_on_ranks(_prefill_decode, 2, tp=2, args=([*BASE, "parallel.tp=2"], 9, [4, 5], 8)):
        assert torch.equal(bits(full), bits(cached))


def test_native_hybrid_gaps_are_measured():
    over = [*BASE, "profile=performance"]
    full, cached = run_on_ranks(_prefill_decode, 1, args=(over, 9, [9]))[0]
    ref = run_on_ranks(_score, 1, args=(over, ALL))[0]
    tp2 = run_on_ranks(_score, 2, tp=2, args=([*over, "parallel.tp=2"], ALL))[0]
    gap = float((full - cached).abs().max())
    print(f"native tiny_hybrid fp32: train vs prefill+decode max |dlogit| {gap:.3e}; TP1 vs TP2 max |dlogp| "
          f"{_max_diff(ref, tp2):.3e}")  # fmt: skip
    assert torch.isfinite(cached).all() and gap >= 0.0


def _hf_reference(overrides: list[str]):
    """Our logits and HF Qwen3NextForCausalLM's on the same random weights (fp32)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from megatron_iso.models.batch import pack
    from megatron_iso.models.weights import random_hf_state_dict

    tc, model = _setup(overrides)
    hf_cfg = Qwen3NextConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.ffn_hidden_size,
        num_hidden_layers=tc.num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_query_groups,
        head_dim=tc.kv_channels,
        linear_num_key_heads=tc.linear_num_key_heads,
        linear_num_value_heads=tc.linear_num_value_heads,
        linear_key_head_dim=tc.linear_key_head_dim,
        linear_value_head_dim=tc.linear_value_head_dim,
        linear_conv_kernel_dim=tc.linear_conv_kernel_dim,
        full_attention_interval=tc.linear_attention_freq,
        num_experts=0,
        rms_norm_eps=tc.layernorm_epsilon,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": tc.rope_theta,
            "partial_rotary_factor": tc.rotary_fraction,
        },
        tie_word_embeddings=False,
    )
    hf_model = Qwen3NextForCausalLM(hf_cfg).eval()
    missing, unexpected = hf_model.load_state_dict(random_hf_state_dict(tc, seed=7), strict=False)
    seq = _sequences(tc.vocab_size, [2])[0]
    with torch.no_grad():
        ours = model.forward_packed(*pack([seq]))
        theirs = hf_model(seq[None]).logits[0]
    return ours, theirs, sorted(missing), sorted(unexpected)


def test_matches_hf_qwen3_next_on_same_weights():
    ours, theirs, missing, unexpected = run_on_ranks(_hf_reference, 1, args=(["model=tiny_hybrid"],))[0]
    assert not missing and not unexpected, (missing, unexpected)
    err = float((ours - theirs).abs().max())
    print(f"tiny_hybrid vs HF Qwen3NextForCausalLM (fp32) max |dlogit| {err:.2e}")
    assert err < 1e-4


def _grads(overrides: list[str]):
    from megatron_iso.models.batch import pack
    from megatron_iso.models.scoring import score_sequences

    tc, model = _setup(overrides)
    model.train()
    ids, batch = pack(_sequences(tc.vocab_size, [0, 2]))
    logp, _ = score_sequences(model, ids, batch)
    logp.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "self_attention" in n and p.grad is not None}


def test_backward_is_deterministic():
    a = run_on_ranks(_grads, 1, args=(BASE,))[0]
    b = run_on_ranks(_grads, 1, args=(BASE,))[0]
    assert any("A_log" in n for n in a) and all(bool(g.abs().sum() > 0) for n, g in a.items() if "conv1d" in n)
    assert a.keys() == b.keys() and all(torch.equal(bits(a[n]), bits(b[n])) for n in a)


def test_iso_hybrid_moe_tp_and_prefill_decode():
    """tiny_hybrid_moe (Qwen3-Next MoE MLP): TP 1 == TP 2 and training forward == prefill + decode."""
    over = ["model=tiny_hybrid_moe", "profile.gdn_chunk=8"]
    ref = run_on_ranks(_score, 1, args=(over, ALL))[0]
    for rank_result in run_on_ranks(_score, 2, tp=2, args=([*over, "parallel.tp=2"], ALL)):
        assert _equal(ref, rank_result), f"max |dlogp| {_max_diff(ref, rank_result):.3e}"
    full, cached = run_on_ranks(_prefill_decode, 1, args=(over, 9, [5, 4], 8))[0]
    assert torch.equal(bits(full), bits(cached)), f"max |dlogit| {(full - cached).abs().max():.3e}"


def test_gdn_form_reaches_the_layer_and_the_cpu_refuses_the_chunk_form():
    """profile.gdn_form travels config -> layer -> op; the chunk form is GPU-only, so a CPU forward says so (its GPU
    equality test: tests/gpu/test_gdn_triton.py::test_tiny_hybrid_training_forward_equals_prefill_decode)."""
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gdn import IsoGatedDeltaNet
    from megatron_iso.parallel.world import single_process_world

    with single_process_world():
        tc, model = _setup([*BASE, "profile.gdn_form=chunk", "profile.gdn_dot_precision=bf16"])
        layers = [m for m in model.modules() if isinstance(m, IsoGatedDeltaNet)]
        assert layers and all((m.form, m.dot_precision) == ("chunk", "bf16") for m in layers)
        ids, batch = pack(_sequences(tc.vocab_size, [0]))
        with torch.no_grad(), pytest.raises(ValueError, match=r"form='chunk', dot_precision='bf16' choose GPU kernels"):
            model.forward_packed(ids, batch)


def test_default_gdn_form_resolves_per_device():
    """The correctness profile's gdn_form=auto reaches the layer as the form that runs on the config's device: the
    chunk form for cuda (a config only: nothing runs here), the scan form for the CPU."""
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.settings.compose import load_config

    for device, form in (("cuda", "chunk"), ("cpu", "scan")):
        tc = transformer_config(load_config(["model=tiny_hybrid", f"device={device}"]))
        assert (tc.iso_gdn_form, tc.iso_gdn_dot_precision) == (form, None), device


def test_gdn_backward_states_reaches_the_layer_and_bad_values_are_named():
    """rl.gdn_backward_states (keep | recompute: what a GPU forward keeps for the backward) travels config -> layer;
    another value is refused naming the field and the allowed values, by the config and by the op."""
    from megatron_iso.models.gdn import IsoGatedDeltaNet
    from megatron_iso.models.transformer_config import gdn_fields
    from megatron_iso.ops.gdn import gated_delta_rule
    from megatron_iso.parallel.world import single_process_world
    from megatron_iso.settings.compose import load_config

    with single_process_world():
        tc, model = _setup([*BASE, "rl.gdn_backward_states=recompute"])
        layers = [m for m in model.modules() if isinstance(m, IsoGatedDeltaNet)]
        assert layers and all(m.backward_states == "recompute" for m in layers)
        assert tc.iso_gdn_backward_states == "recompute"
    cfg = load_config(["model=tiny_hybrid"])
    with pytest.raises(ValueError, match=r"rl.gdn_backward_states='all' is not allowed; allowed values: \['keep', 'r"):
        gdn_fields(cfg.model, cfg.profile, {"gdn_backward_states": "all"}, "cpu")
    x = [torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), torch.zeros(3, 1), torch.zeros(3, 1)]
    with pytest.raises(
        ValueError, match=r"backward_states \(rl.gdn_backward_states\)='all' is not allowed; allowed values: \['keep'"
    ):
        gated_delta_rule(*x, torch.tensor([0, 3]), backward_states="all")
