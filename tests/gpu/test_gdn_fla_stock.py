"""The performance profile's GDN rollout on CUDA runs FLA's kernels (ops.gdn.fla_stock): a packed prefill of
sequences crossing chunk boundaries, then decode steps from the slots' states, give what the torch native path gives
(the HF-style chunk algorithm and recurrence) within bf16 tolerance, outputs and final states alike."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("fla")


def _inputs(t: int, hk: int = 4, hv: int = 8, d: int = 64, seed: int = 0):
    from megatron_iso.ops.gdn import native

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k = native.l2norm(rnd(t, hk, d)).bfloat16(), native.l2norm(rnd(t, hk, d)).bfloat16()
    v = rnd(t, hv, d).bfloat16()
    g, beta = native.gdn_gates(rnd(t, hv), rnd(t, hv), torch.zeros(hv, device="cuda"), torch.ones(hv, device="cuda"))
    return q, k, v, g, beta


def _run(monkeypatch, use_fla: bool):
    from megatron_iso.ops.gdn import fla_stock, native
    from megatron_iso.ops.gdn.state_cache import GDNLayerState

    if not use_fla:
        monkeypatch.setattr(fla_stock, "serves", lambda *a: False)
    lens = [70, 5, 130]
    state = GDNLayerState.allocate(
        4, conv_dim=8, conv_kernel=4, key_heads=4, value_heads=8, key_dim=64, value_dim=64, chunk=64, device="cuda"
    )
    slots = torch.tensor([2, 0, 1], device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    outs = []
    with torch.no_grad():
        outs.append(native.gated_delta_rule(*_inputs(sum(lens)), cu, state=state, slots=slots))
        pos = torch.tensor(lens, device="cuda")
        for step in range(3):  # one token per sequence, resuming from its slot
            outs.append(
                native.gated_delta_rule(
                    *_inputs(3, seed=step + 1), torch.arange(4, device="cuda"), state=state, slots=slots, starts=pos
                )
            )
            pos = pos + 1
    monkeypatch.undo()
    return outs, state.running[slots].clone()


def test_fla_rollout_matches_the_torch_native_path(monkeypatch):
    fla_out, fla_state = _run(monkeypatch, use_fla=True)
    ref_out, ref_state = _run(monkeypatch, use_fla=False)
    for i, (a, b) in enumerate(zip(fla_out, ref_out, strict=True)):
        assert a.dtype == torch.float32 and a.shape == b.shape, i
        assert float((a - b).abs().max()) <= 0.03 * float(b.abs().max()) + 1e-3, i
    assert float((fla_state - ref_state).abs().max()) <= 0.03 * float(ref_state.abs().max()) + 1e-3
