"""Context parallelism (``parallel.cp``): every token's logprob at CP 2 and 4, and at CP 2 with TP 2 + SP, equals
CP 1's bit for bit (dense and MoE), on a packed batch of uneven sequence lengths whose total does not divide by
2 * CP (the pack is padded with a filler sequence); the backward runs and its gradients match CP 1 closely.

One spawn of 4 gloo ranks runs every layout (``parallel.layouts``: a layout per CP/TP degree on the same ranks).
"""

from __future__ import annotations

import pytest
import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

pytestmark = pytest.mark.slow

LENGTHS = (13, 5, 22, 1, 9)  # 50 tokens: not a multiple of 2 * CP for CP 2 or 4
LAYOUTS = {"cp1": (1, 1, False), "cp2": (1, 2, False), "cp4": (1, 4, False), "tp2_sp_cp2": (2, 2, True)}


def _score(model_name: str, tp: int, cp: int, sp: bool, profile: str) -> dict:
    from megatron_iso.models.batch import pack, row_multiple
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.scoring import score_sequences
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    cfg = load_config([f"model={model_name}", f"profile={profile}", f"parallel.tp={tp}", f"parallel.cp={cp}",
                       f"parallel.sp={str(sp).lower()}"])  # fmt: skip
    tc = transformer_config(cfg)
    model = build_model(tc, random_hf_state_dict(tc, seed=7))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, tc.vocab_size, (n,), generator=g) for n in LENGTHS]
    ids, batch = pack(seqs, pad_to_multiple=row_multiple(tc), vocab_size=tc.vocab_size)
    from megatron_iso.models.context import shard_for_context

    shard = shard_for_context(ids, batch, tc)
    local_rows = 0 if shard is None else shard[0].numel()
    rows = torch.arange(2, ids.numel() - 1, 3)  # some rows, as the trainer scores the response rows only
    with torch.no_grad():
        logp, ent = score_sequences(model, ids, batch, rows=rows)
    logp_all, _ = score_sequences(model, ids, batch, with_entropy=False)  # with autograd: the backward below
    logp_all.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if n.endswith(("word_embeddings.weight",
             "linear_qkv.weight"))}  # fmt: skip
    if cp > 1:  # what Megatron's DDP does with them: the mean over the data x context parallel ranks
        import torch.distributed as dist
        from megatron.core import parallel_state

        for g in grads.values():
            dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
            g /= cp
    return {"logp": logp, "ent": ent, "logp_all": logp_all.detach(), "grads": grads, "local_rows": local_rows}


def _worker(model_name: str, profile: str, names: tuple[str, ...] = tuple(LAYOUTS)) -> dict:
    from megatron_iso.parallel.layouts import ParallelLayout

    layouts = {k: ParallelLayout.create(LAYOUTS[k][0], cp=LAYOUTS[k][1]) for k in names}
    out = {}
    for name in names:
        tp, cp, sp = LAYOUTS[name]
        with layouts[name].active():
            out[name] = _score(model_name, tp, cp, sp, profile)
    return out


def test_performance_profile_runs_the_same_scheme_at_cp_2():
    """The performance profile's CP: the same row split and K/V all-gather around the stock attention (SDPA), no
    fixed-order promise: it runs forward and backward, and its logprobs are close to its CP 1's."""
    for res in run_on_ranks(_worker, 2, args=("tiny_dense", "performance", ("cp1", "cp2"))):
        assert res["cp2"]["local_rows"] == 26  # 50 rows padded to 52, half per rank
        a, b = res["cp2"]["logp_all"], res["cp1"]["logp_all"]
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-3 * b.abs().max()


@pytest.mark.parametrize("model_name", ["tiny_dense", "tiny_moe"])
def test_logprobs_at_cp_2_and_4_equal_cp_1(model_name):
    results = run_on_ranks(_worker, 4, args=(model_name, "correctness"))
    base = results[0]["cp1"]
    assert base["logp"].abs().sum() > 0
    for rank, res in enumerate(results):
        for name in LAYOUTS:
            for key in ("logp", "ent", "logp_all"):
                got = res[name][key]
                assert got.shape == base[key].shape, (rank, name, key)
                assert torch.equal(bits(got), bits(base[key])), (rank, name, key)
            # Each CP rank ran its share of the padded pack (2 * CP * (TP under SP) divides it), not the whole.
            tp, cp, sp = LAYOUTS[name]
            padded = -(-sum(LENGTHS) // (2 * cp * (tp if sp else 1))) * 2 * cp * (tp if sp else 1)
            assert res[name]["local_rows"] == (0 if cp == 1 else padded // cp), (rank, name)
            # The backward: deterministic, not bitwise CP-invariant (dK/dV are summed over ranks): close to CP 1.
            for p, g in res[name]["grads"].items() if tp == 1 else ():  # TP shards differ in shape
                ref = base["grads"][p].float()
                assert (g.float() - ref).abs().max() <= 1e-2 * ref.abs().max(), (rank, name, p)
