"""Context parallelism on the Gated DeltaNet hybrid (tiny_hybrid, GDN chunk 8): every token's logprob at CP 2, CP 4
and TP 2 + SP + CP 2 equals CP 1's and the rollout engine's bit for bit, with the GDN state passed rank to rank
(``models.gdn_context``). The pack (sequences of 7, 9, 20 and 9 tokens the engine generated, 45 rows) is padded to 48
with a filler sequence; its zigzag chunk edges fall inside GDN chunks and conv windows, on a GDN chunk boundary, and
exactly where a sequence starts, and at CP 4 (6-row chunks) a halo reaches back over two ranks' rows
(:func:`test_the_pack_covers_the_chain_cases`). Each rank's GDN layers run only its own rows and halos.
The GDN layers' gradients are close to CP 1's (the backward sums over CP ranks: not bitwise).

One spawn of 4 gloo ranks runs every layout (``parallel.layouts``).
"""

from __future__ import annotations

from functools import partial
from unittest import mock

import pytest
import torch

from megatron_iso.models.gdn_context import chain_plan
from megatron_iso.testing.bits import bit_difference, bits
from megatron_iso.testing.harness import run_on_ranks

pytestmark = pytest.mark.slow

GDN_CHUNK, CONV_KERNEL = 8, 4  # tiny_hybrid's linear_conv_kernel_dim
OVERRIDES = ["model=tiny_hybrid", f"profile.gdn_chunk={GDN_CHUNK}"]
PROMPTS = ((301, 1), (302, 3), (303, 14), (304, 3))  # (seed, length); 6 new tokens each: 7, 9, 20, 9 rows
BOUNDS = (0, 7, 16, 36, 45, 48)  # the padded pack (CP 2, CP 4, TP 2 + SP + CP 2 all pad to 48)
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


def _gdn_rows(fn):
    """Run ``fn`` recording the rows of every GDN conv and delta-rule call, and whether any GDN layer ran the
    whole-pack fallback."""
    from megatron_iso.models import gdn, gdn_context

    seen = {"conv": [], "rule": []}
    conv = mock.patch.object(gdn, "causal_conv1d", wraps=gdn.causal_conv1d)
    rule = mock.patch.object(gdn_context, "gated_delta_rule_carry", wraps=gdn_context.gated_delta_rule_carry)
    whole = mock.patch.object(gdn.IsoGatedDeltaNet, "_mix_whole_pack", autospec=True,
                              side_effect=gdn.IsoGatedDeltaNet._mix_whole_pack)  # fmt: skip
    with conv as c, rule as r, whole as w:
        out = fn()
    seen["conv"] = [call.args[0].shape[0] for call in c.call_args_list]
    seen["rule"] = [call.args[0].shape[0] for call in r.call_args_list]
    seen["whole_pack"] = w.call_count
    return out, seen


def _score(samples, tp: int, cp: int, sp: bool, profile: str = "correctness") -> dict:
    from megatron_iso.models.batch import pack, row_multiple
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.scoring import score_sequences
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    cfg = load_config([*OVERRIDES, f"profile={profile}", f"parallel.tp={tp}", f"parallel.cp={cp}",
                       f"parallel.sp={str(sp).lower()}"])  # fmt: skip
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
    return {"logp": logp.detach()[:real], "generated": logp.detach()[rows], "grads": grads, "cu": cu}


def _worker() -> dict:
    from megatron_iso.parallel.layouts import ParallelLayout

    layouts = {k: ParallelLayout.create(tp, cp=cp) for k, (tp, cp, _) in LAYOUTS.items()}
    with layouts["cp1"].active():
        samples = _rollout()
    out = {"rollout": torch.tensor([x for *_, lp in samples for x in lp], dtype=torch.float32)}
    for name, (tp, cp, sp) in LAYOUTS.items():
        with layouts[name].active():
            out[name], out[f"{name}_gdn_rows"] = _gdn_rows(partial(_score, samples, tp, cp, sp))
    for cp in (1, 2):  # the performance profile (the native rule carries no state): the whole-pack fallback
        run = partial(_score, samples, 1, cp, False, "performance")
        with layouts[f"cp{cp}"].active():
            out[f"perf_cp{cp}"], out[f"perf_cp{cp}_gdn_rows"] = _gdn_rows(run)
    return out


def test_hybrid_logprobs_at_cp_equal_cp_1_and_the_rollout():
    results = run_on_ranks(_worker, 4)
    base = results[0]["cp1"]
    assert tuple(base["cu"]) == BOUNDS[:-1] and base["logp"].abs().sum() > 0, base["cu"]
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

    # Per-rank GDN work: each conv / rule call runs one CP chunk's rows (T / 2CP) plus its halo (fewer than
    # gdn_chunk + kernel - 1 rows), never the pack; two calls per GDN layer (3 layers), none in the backward.
    for res in results:
        for name, (_, cp, _) in LAYOUTS.items():
            rows = res[f"{name}_gdn_rows"]
            if cp == 1:  # the whole pack in one call per layer (the rule without a carried state)
                assert rows["conv"] == [BOUNDS[-2]] * 3 and rows["rule"] == [] and rows["whole_pack"] == 0, rows
                continue
            chunk = BOUNDS[-1] // (2 * cp)
            assert rows["whole_pack"] == 0 and len(rows["conv"]) == len(rows["rule"]) == 6, (name, rows)
            assert max(rows["rule"]) <= chunk + GDN_CHUNK - 1, (name, rows)
            assert max(rows["conv"]) <= chunk + GDN_CHUNK + CONV_KERNEL - 2, (name, rows)
            assert max(rows["conv"]) < BOUNDS[-1] // 2, (name, rows)

    # The performance profile keeps the whole-pack scheme (each GDN layer once per forward) and stays close to its CP 1.
    for res in results:
        assert res["perf_cp2_gdn_rows"]["whole_pack"] == 3 and res["perf_cp1_gdn_rows"]["whole_pack"] == 0
        a, b = res["perf_cp2"]["logp"], res["perf_cp1"]["logp"]
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_the_pack_covers_the_chain_cases():
    """The hybrid pack's links (``models.gdn_context.chain_plan``) include each case the state chain handles."""
    found = set()
    for cp in (2, 4):
        rows = BOUNDS[-1] // (2 * cp)
        for rank in range(cp):
            for work in chain_plan(BOUNDS, cp, rank, GDN_CHUNK, CONV_KERNEL):
                link = work.incoming
                if link is None:
                    found.add(f"cp{cp}: a sequence starts at a chunk edge" if 0 < work.lo in BOUNDS else "")
                    continue
                found.add(f"cp{cp}: link at a GDN chunk boundary" if link.rule_start == work.lo else "")
                found.add(f"cp{cp}: link inside a GDN chunk" if link.rule_start < work.lo else "")
                found.add(f"cp{cp}: halo from two ranks" if link.halo_start < work.lo - rows else "")
                found.add(f"cp{cp}: the middle link (same rank)" if work.prev_peer is None else "")
                found.add(f"cp{cp}: a sequence across a whole chunk" if work.outgoing is not None else "")
    want = {f"cp{cp}: {case}" for cp in (2, 4) for case in ("a sequence starts at a chunk edge",
            "link at a GDN chunk boundary", "link inside a GDN chunk", "the middle link (same rank)")}  # fmt: skip
    want |= {"cp4: halo from two ranks", "cp4: a sequence across a whole chunk"}
    assert want <= found, sorted(want - found)
