"""The performance profile's static MoE dispatch (``models.moe_serving``: serving steps, CUDA-graph decode) against
Megatron's MoELayer, and its host reads.

tiny_moe (8 experts, top-2, a gated shared expert) in fp32 and bf16; decode-sized (1, 5 rows) and prefill-sized (96
rows) batches; random routing, a router with two identical expert rows (every token's scores for experts 3 and 5
tie) and a zero router (all scores tie). The static dispatch must give Megatron's layer output within fp32 / bf16
rounding, by torch's grouped GEMM and by the masked fallback, and read nothing on the host where Megatron's
dispatcher reads its counts. A model call takes the static dispatch only for a batch with a KV cache."""

from __future__ import annotations

import torch

from megatron_iso.testing.harness import run_on_ranks

ROWS = (1, 5, 96)


def _cases(dtype: str) -> dict:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_iso.models import moe_serving
    from megatron_iso.models.batch import pack
    from megatron_iso.ops.attention.kv_cache import KVCache
    from megatron_iso.ops.gemm import grouped_stock
    from megatron_iso.testing.host_reads import HostReadCounter
    from tests.inference import engine_cases

    tc, model = engine_cases.setup(["model=tiny_moe", "profile=performance", f"model.params_dtype={dtype}"])
    moe = model.decoder.layers[0].mlp
    g = torch.Generator().manual_seed(3)
    out: dict = {"cases": [], "type": type(moe).__name__}
    serving = moe_serving._SERVING
    with torch.no_grad():
        for routing in ("random", "two tied experts", "zero router"):
            if routing == "two tied experts":
                moe.router.weight[5] = moe.router.weight[3]
            elif routing == "zero router":
                moe.router.weight.zero_()
            for rows in ROWS:
                x = torch.randn(rows, 1, tc.hidden_size, generator=g).to(tc.params_dtype)
                ref = MoELayer.forward(moe, x)[0]
                token = serving.set(True)
                try:
                    static = moe(x)[0]
                    real = grouped_stock.library_kernel_serves
                    grouped_stock.library_kernel_serves = lambda *a: False  # the masked fallback
                    try:
                        masked = moe(x)[0]
                    finally:
                        grouped_stock.library_kernel_serves = real
                finally:
                    serving.reset(token)
                out["cases"].append(((routing, rows), ref, static, masked))
        # Host reads: none in the static dispatch; Megatron's dispatcher reads its counts.
        x = torch.randn(16, 1, tc.hidden_size, generator=g).to(tc.params_dtype)
        reads = {}
        for name, on in (("static", True), ("megatron", False)):
            token = serving.set(on)
            try:
                with HostReadCounter() as counter:
                    counter.seed(model, x)
                    moe(x)
                    reads[name] = counter.summary()
            finally:
                serving.reset(token)
        out["reads"] = reads
        # A model call: the static dispatch for a batch with a KV cache (prefill), Megatron's for a trainer pack.
        calls = []
        real_serve = moe_serving.NativeMoELayer.serve

        def counted(self, h):
            calls.append(h.shape[0])
            return real_serve(self, h)

        moe_serving.NativeMoELayer.serve = counted
        try:
            seqs = [[3, 5, 7], [11, 2]]
            ids, batch = pack(seqs)
            model.forward_packed(ids, batch)
            trainer_calls = len(calls)
            cache = KVCache.allocate(tc.num_layers, 2, 8, tc.num_query_groups, tc.kv_channels, dtype=tc.params_dtype)
            ids, batch = pack(seqs, case="prefill", kv_cache=cache, slots=[0, 1])
            model.forward_packed(ids, batch)
        finally:
            moe_serving.NativeMoELayer.serve = real_serve
        out["model_calls"] = (trainer_calls, calls)
    return out


def _tolerance(dtype: str, ref: torch.Tensor) -> dict:
    scale = float(ref.float().abs().max())  # the output's scale (tolerances relative to it)
    return {"rtol": 0.0, "atol": (1e-5 if dtype == "fp32" else 2e-2) * scale}


def test_static_native_dispatch_gives_megatrons_moe_layer_output() -> None:
    for dtype in ("fp32", "bf16"):
        res = run_on_ranks(_cases, 1, args=(dtype,))[0]
        assert res["type"] == "NativeMoELayer"
        assert len(res["cases"]) == 3 * len(ROWS)
        for case, ref, static, masked in res["cases"]:
            assert static.dtype == ref.dtype and static.shape == ref.shape, (dtype, case)
            torch.testing.assert_close(static, ref, **_tolerance(dtype, ref), msg=f"{dtype} {case} grouped_mm")
            torch.testing.assert_close(masked, ref, **_tolerance(dtype, ref), msg=f"{dtype} {case} masked")
        assert res["reads"]["static"] == {}, res["reads"]["static"]
        assert res["reads"]["megatron"], "the counter must see Megatron's dispatcher read its counts"
        trainer_calls, serving_calls = res["model_calls"]
        # tiny_moe: 2 MoE layers; the trainer pack runs Megatron's layer, the prefill the static dispatch on 5 rows
        assert trainer_calls == 0 and serving_calls == [5, 5], res["model_calls"]
