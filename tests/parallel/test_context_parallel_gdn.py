"""Context parallelism on the Gated DeltaNet hybrid (tiny_hybrid, GDN chunk 4): every token's logprob at CP 2, CP 4
and TP 2 + SP + CP 2 equals CP 1's and the rollout engine's bit for bit. The pack (sequences the engine generated,
51 tokens) is padded with a filler sequence, and the zigzag chunk edges fall inside GDN chunks and conv windows.
The GDN layers' gradients are close to CP 1's (the backward sums over CP ranks: not bitwise).

One spawn of 4 gloo ranks runs every layout (``parallel.layouts``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bit_difference, bits
from megatron_iso.testing.harness import run_on_ranks

pytestmark = pytest.mark.slow

OVERRIDES = ["model=tiny_hybrid", "profile.gdn_chunk=4"]
PROMPTS = ((301, 5), (302, 1), (303, 12), (304, 9))  # (seed, length); 6 new tokens each: 51 rows
LAYOUTS = {"cp1": (1, 1, False), "cp2": (1, 2, False), "cp4": (1, 4, False), "tp2_sp_cp2": (2, 2, True)}
# Parameters of the GDN layers (layers 1-3) whose gradients are compared, TP 1 layouts only (TP shards them).
GDN_PARAMS = ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight", "out_proj.weight")


def _rollout() -> list[list[int]]:
    """The engine's samples (CP 1: the engine never splits rows) and their recorded logprobs."""
    from megatron_iso.inference import EngineConfig, Request, RolloutEngine, SamplingParams
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    tc = transformer_config(load_config(OVERRIDES))
    model = build_model(tc, random_hf_state_dict(tc, seed=7)).eval()
    reqs = [
        Request(s, torch.randint(0, tc.vocab_size, (n,), generator=torch.Generator().manual_seed(s)).tolist(),
                SamplingParams(max_new_tokens=6, seed=11, temperature=1.0))
        for s, n in PROMPTS
    ]  # fmt: skip
    outs = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4)).generate(reqs)
    return [(r.prompt, o.samples[0].tokens, o.samples[0].logprobs) for r, o in zip(reqs, outs, strict=True)]


def _score(samples, tp: int, cp: int, sp: bool) -> dict:
    from megatron_iso.models.batch import pack, row_multiple
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.scoring import score_sequences
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    cfg = load_config([*OVERRIDES, f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.sp={str(sp).lower()}"])
    tc = transformer_config(cfg)
    model = build_model(tc, random_hf_state_dict(tc, seed=7))
    ids, batch = pack([p + t for p, t, _ in samples], pad_to_multiple=row_multiple(tc), vocab_size=tc.vocab_size)
    logp, _ = score_sequences(model, ids, batch, with_entropy=False)
    logp.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if n.endswith(GDN_PARAMS)}
    if cp > 1:  # what Megatron's DDP does with them: the mean over the data x context parallel ranks
        import torch.distributed as dist
        from megatron.core import parallel_state

        for g in grads.values():
            dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
            g /= cp
    cu = batch.cu_seqlens_q.tolist()
    # Row cu[i] + len(prompt) - 1 + j scores generated token j of sample i: the rows the engine recorded.
    rows = torch.cat([torch.arange(len(t)) + cu[i] + len(p) - 1 for i, (p, t, _) in enumerate(samples)])
    real = sum(len(p) + len(t) for p, t, _ in samples)  # SP's pack padding (a filler sequence) left out
    return {"logp": logp.detach()[:real], "generated": logp.detach()[rows], "grads": grads}


def _worker() -> dict:
    from megatron_iso.parallel.layouts import ParallelLayout

    layouts = {k: ParallelLayout.create(tp, cp=cp) for k, (tp, cp, _) in LAYOUTS.items()}
    with layouts["cp1"].active():
        samples = _rollout()
    out = {"rollout": torch.tensor([x for *_, lp in samples for x in lp], dtype=torch.float32)}
    for name, (tp, cp, sp) in LAYOUTS.items():
        with layouts[name].active():
            out[name] = _score(samples, tp, cp, sp)
    return out


def test_hybrid_logprobs_at_cp_equal_cp_1_and_the_rollout():
    results = run_on_ranks(_worker, 4)
    base = results[0]["cp1"]
    assert base["logp"].numel() == 51 and base["logp"].abs().sum() > 0
    for rank, res in enumerate(results):
        assert torch.equal(bits(res["rollout"]), bits(base["generated"])), (rank, "rollout")
        for name, (tp, _, _) in LAYOUTS.items():
            got = res[name]
            assert torch.equal(bits(got["logp"]), bits(base["logp"])), (rank, name, bit_difference(got["logp"],
                                                                                                   base["logp"]))  # fmt: skip
            for p, g in got["grads"].items() if tp == 1 else ():
                ref = base["grads"][p]
                assert ref.abs().max() > 0, p
                assert (g - ref).abs().max() <= 1e-5 * ref.abs().max(), (rank, name, p)
