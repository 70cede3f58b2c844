"""Activation recompute (rl.recompute_*, Megatron's TransformerConfig fields) under the iso layers: the backward
reruns the forward of what it recomputes through Megatron's ``tensor_parallel.checkpoint`` (its RNG tracker on
the CPU, our autograd functions inside), and the logprobs and every gradient keep their bits."""

from __future__ import annotations

import pytest
import torch

from megatron_iso.settings import SettingsError
from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

VARIANTS = {
    "off": [],
    "selective": ["rl.recompute_granularity=selective"],
    "selective_mlp": ["rl.recompute_granularity=selective", "rl.recompute_modules=[core_attn,mlp]"],
    "full_uniform": ["rl.recompute_granularity=full", "rl.recompute_method=uniform", "rl.recompute_num_layers=1"],
    "full_block": ["rl.recompute_granularity=full", "rl.recompute_method=block", "rl.recompute_num_layers=1"],
}


def _logprobs_and_grads(model_overrides: list[str], variants: tuple[str, ...]) -> dict:
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_iso.models.batch import pack
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.scoring import score_sequences
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    recomputed = []  # one entry per checkpointed region the backward reran: proof the variant recomputes
    backward = mrandom.CheckpointFunction.backward
    mrandom.CheckpointFunction.backward = staticmethod(lambda ctx, *g: recomputed.append(1) or backward(ctx, *g))
    out = {}
    for name in variants:
        overrides = VARIANTS[name]
        recomputed.clear()
        tc = transformer_config(load_config([*model_overrides, *overrides]))
        assert tc.recompute_granularity == (overrides[0].split("=")[1] if overrides else None)
        model = build_model(tc, random_hf_state_dict(tc, seed=5))
        g = torch.Generator().manual_seed(11)
        seqs = [torch.randint(0, tc.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 5)]
        ids, batch = pack(seqs)
        logp, _ = score_sequences(model, ids, batch, with_entropy=False)
        weights = torch.linspace(-1.0, 1.0, logp.numel())  # every row's gradient differs
        (logp.float() * weights).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        assert len(grads) == len(list(model.parameters()))
        out[name] = {"logp": logp.detach(), "grads": grads, "recomputed": len(recomputed)}
    return out


# The GDN + MoE hybrid (the model the memory target is about) under full recompute only: its MoE layers rerun
# through IsoMoETransformerLayer's recompute path (models.moe.recomputed_static_shapes); selective recompute's
# submodules are the dense ones the other models cover.
@pytest.mark.parametrize(
    ("model", "variants"),
    [
        (["model=tiny_dense"], tuple(VARIANTS)),
        (["model=tiny_hybrid", "profile.gdn_chunk=4"], tuple(VARIANTS)),
        (["model=tiny_hybrid_moe", "profile.gdn_chunk=4", "rl.gdn_backward_states=recompute"], ("off", "full_uniform")),
    ],
    ids=["dense", "hybrid", "hybrid_moe"],
)
def test_recompute_keeps_logprobs_and_gradients_bit_for_bit(model, variants):
    runs = run_on_ranks(_logprobs_and_grads, 1, args=(model, variants))[0]
    off = runs.pop("off")
    assert off["recomputed"] == 0
    for name, run in runs.items():
        assert run["recomputed"] > 0, name
        assert torch.equal(bits(run["logp"]), bits(off["logp"])), name
        for n, g in off["grads"].items():
            assert torch.equal(bits(run["grads"][n]), bits(g)), (name, n)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["rl.recompute_granularity=some"], "rl.recompute_granularity"),
        (["rl.recompute_granularity=full"], "rl.recompute_method"),
        (["rl.recompute_granularity=full", "rl.recompute_method=chunk", "rl.recompute_num_layers=1"], "uniform"),
        (["rl.recompute_granularity=selective", "rl.recompute_modules=[moe_act]"], "rl.recompute_modules"),
        (["rl.recompute_method=block"], "rl.recompute_granularity is null"),
    ],
)
def test_bad_recompute_settings_name_the_field(overrides, named):
    from megatron_iso.settings import resolve
    from megatron_iso.settings.compose import load_config

    with pytest.raises(SettingsError, match=named):
        resolve(load_config(overrides))
