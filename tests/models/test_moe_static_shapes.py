"""The MoE layer's static-shape forward (``models.moe.static_shapes``: CUDA-graph decode steps, EP 1)
gives the eager forward's bits on every real row and reads nothing on the host.

A decode bucket holds B rows, n real and the rest padding whose outputs are dropped: the static
forward on all B rows must give rows ``:n`` the bits of the eager forward on the n real rows alone,
for several n, random routing and a routing that leaves most experts empty (a zero router: every row
ties, so every row takes experts 0 and 1), fp32 and bf16, padding rows of zeros and of huge values. A
model call with ``IsoBatch.static_shapes`` takes the static path (the CPU grouped GEMM's static variant
runs). The captured graph on a GPU: tests/gpu/test_moe_static_graph.py."""

from __future__ import annotations

from unittest import mock

import torch

from megatron_iso.testing.bits import bits
from megatron_iso.testing.harness import run_on_ranks

BUCKET = 16
SIZES = (1, 3, 7, 16)


def _layer_cases(dtype: str) -> dict:
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.moe import static_shapes
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.ops.gemm import grouped
    from megatron_iso.settings.compose import load_config
    from megatron_iso.testing.host_reads import HostReadCounter

    tc = transformer_config(load_config(["model=tiny_moe", f"model.params_dtype={dtype}"]))
    model = build_model(tc, random_hf_state_dict(tc, seed=7, std=0.2)).eval()
    moe = model.decoder.layers[0].mlp
    g = torch.Generator().manual_seed(5)
    x = torch.randn(BUCKET, 1, tc.hidden_size, generator=g).to(tc.params_dtype)
    x[12:14] = 0  # padding rows as a bucket holds them (its token 0's hidden state differs; any value will do)
    x[14:] = 1e4
    out: dict = {"layer": []}
    with torch.no_grad():
        for routing in ("random", "zero router"):
            if routing == "zero router":
                moe.router.weight.zero_()
            with static_shapes():
                full = moe(x)[0]
            for n in SIZES:
                eager = moe(x[:n])[0]
                out["layer"].append(((routing, n), bits(full[:n]), bits(eager)))
        # No host reads in the static forward; the counter sees the eager one's.
        reads = {}
        for name, ctx in (("static", static_shapes()), ("eager", static_shapes(False))):
            with HostReadCounter() as counter, ctx:
                counter.seed(model, x)
                moe(x)
                reads[name] = counter.summary()
        out["reads"] = reads
        # A model call with IsoBatch.static_shapes runs the static path, with the eager logits' bits.
        ids, batch = pack([[3, 5, 7], [11]], device="cpu")
        with mock.patch.object(grouped, "grouped_reference_static", wraps=grouped.grouped_reference_static) as spy:
            eager_logits = model.forward_packed(ids, batch)
            eager_calls = spy.call_count
            batch.static_shapes = True
            static_logits = model.forward_packed(ids, batch)
        out["model"] = (bits(eager_logits), bits(static_logits), eager_calls, spy.call_count)
        # The dispatcher takes (experts, weights) from its router's RoutedTokens; without them it recovers the same
        # from routing_map and probs (a sort and a device check under static shapes): the same bits either way.
        import megatron_iso.models.moe as moe_module

        dispatcher = moe.token_dispatcher
        handoff = {}
        with mock.patch.object(moe_module, "_routed_experts", wraps=moe_module._routed_experts) as recovered:
            try:
                for name, router in (("handoff", moe.router), ("recovered", None)):
                    dispatcher.router = router
                    for ctx_name, ctx in (("static", static_shapes()), ("eager", static_shapes(False))):
                        with ctx:
                            handoff[(name, ctx_name)] = bits(moe(x)[0])
                        if router is not None:
                            handoff[("left", ctx_name)] = getattr(router, "last_route", "unset")
            finally:
                dispatcher.router = moe.router
        out["handoff"] = (handoff, recovered.call_count)
        # The grouped GEMMs check their counts on the device except in a serving step (the counts are then the
        # column sums of the routing map this step's router built); the same bits either way.
        with mock.patch.object(moe_module, "grouped_linear", wraps=moe_module.grouped_linear) as gemms:
            with static_shapes():
                trainer_like = bits(moe(x)[0])
            with mock.patch.object(moe_module, "serving_active", return_value=True), static_shapes():
                serving = bits(moe(x)[0])
        out["checks"] = ([c.kwargs["check_counts"] for c in gemms.call_args_list], trainer_like, serving)
    return out


def test_static_moe_forward_gives_the_eager_bits() -> None:
    for dtype in ("fp32", "bf16"):
        res = run_on_ranks(_layer_cases, 1, args=(dtype,))[0]
        assert len(res["layer"]) == 2 * len(SIZES)
        for case, static, eager in res["layer"]:
            assert torch.equal(static, eager), (dtype, case)
        assert res["reads"]["static"] == {}, res["reads"]["static"]
        assert res["reads"]["eager"], "the eager forward plans the expert splits on the host"
        eager_logits, static_logits, eager_calls, calls = res["model"]
        assert torch.equal(static_logits, eager_logits), dtype
        # tiny_moe: 2 MoE layers, 2 grouped GEMMs each, only in the static call
        assert (eager_calls, calls) == (0, 4)
        handoff, recovered = res["handoff"]
        for path in ("static", "eager"):
            assert torch.equal(handoff[("handoff", path)], handoff[("recovered", path)]), (dtype, path)
        assert recovered == 1  # only the static call without the router's RoutedTokens recovered the experts
        assert handoff[("left", "static")] is None and handoff[("left", "eager")] is None  # consumed by the dispatcher
        checks, trainer_like, serving = res["checks"]
        assert checks == [True, True, False, False] and torch.equal(trainer_like, serving), (dtype, checks)
