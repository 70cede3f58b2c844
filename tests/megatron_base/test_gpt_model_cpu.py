"""The base the project stands on: Megatron-Core GPTModel (local spec) on CPU gloo ranks."""

from __future__ import annotations

import torch

from megatron_iso.testing.harness import run_on_ranks

VOCAB, SEQ, BATCH = 128, 16, 2


def _build_gpt(tp: int, sp: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        params_dtype=torch.float32,
    )
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ)[None].expand(BATCH, -1)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    return ids, pos, mask


def _forward_backward(tp: int, sp: bool):
    model = _build_gpt(tp, sp)
    ids, pos, mask = _batch()
    loss = model(ids, pos, mask, labels=ids)
    loss.mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return {
        "loss": loss.detach(),
        "grads_finite": all(g is not None and torch.isfinite(g).all().item() for g in grads),
        "n_grads": len(grads),
    }


def test_gpt_forward_backward_tp1():
    (res,) = run_on_ranks(_forward_backward, 1, tp=1, args=(1, False))
    assert res["loss"].shape == (BATCH, SEQ)
    assert torch.isfinite(res["loss"]).all()
    assert res["grads_finite"] and res["n_grads"] > 0
    # A random 128-way model starts near log(128) per token.
    assert abs(res["loss"].mean().item() - torch.log(torch.tensor(float(VOCAB))).item()) < 1.0


def test_gpt_forward_backward_tp2_sp():
    results = run_on_ranks(_forward_backward, 2, tp=2, args=(2, True))
    assert len(results) == 2
    # The loss is computed after the vocab-parallel cross entropy: both TP ranks hold the same values.
    assert torch.equal(results[0]["loss"], results[1]["loss"])
    assert all(r["grads_finite"] and r["n_grads"] > 0 for r in results)


def _optimizer_step_dp2():
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _build_gpt(1, False)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=False)
    model = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=False), [model])
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad_buffer()
    opt.zero_grad()
    # Each DP rank sees different data; the reduced gradient is the same everywhere.
    ids, pos, mask = _batch(seed=parallel_state.get_data_parallel_rank())
    loss = model(ids, pos, mask, labels=ids).mean()
    loss.backward()
    model.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    after = [p.detach().clone() for p in model.parameters()]
    changed = sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {"ok": ok, "grad_norm": grad_norm, "changed": changed, "params": after}


def test_megatron_optimizer_step_dp2():
    r0, r1 = run_on_ranks(_optimizer_step_dp2, 2, tp=1)
    assert r0["ok"] and r1["ok"]
    assert r0["changed"] > 0
    assert r0["grad_norm"] == r1["grad_norm"] and r0["grad_norm"] > 0
    # Data parallel replicas must hold identical parameters after the step.
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)
