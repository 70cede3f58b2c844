"""The performance profile's GDN rollout on CUDA runs FLA's kernels (``ops.gdn.fla_stock``) at Qwen3.5's GDN widths
(16 key heads, 32 value heads, Dk = Dv = 128), bf16, and gives what the torch native path gives within bf16's reach,
outputs and final states alike: a packed prefill of sequences crossing FLA's 64-token chunks, a mixed call (a resumed
prefill, a decode step, a fresh sequence), then decode steps from the slots' states. The trainer's calls (autograd, or
no state cache: scoring) stay on the torch chunk algorithm.

Bound: 2^-4 of the largest reference entry, 32 bf16 unit roundoffs (u = 2^-9). FLA keeps its inputs and the
intermediates it stores in the input dtype: q, k and beta (rounded at the call; the torch path keeps them fp32),
T^-1, w, u and v_new = u - W S, the chunk states and the intra-chunk scores that feed the output dots: about eight
bf16 roundings on a result's path. v_new subtracts the state's prediction of the value from the value, two terms of
the size of v, which scales their roundoff by |u| / |v_new|; allowing a factor 4 for that: 8 * 4 * u = 2^-4. The
state error of one call carries into the next only through decays <= 1 and the delta rule's contraction
(I - beta k k^T), so it does not grow over the calls. Measured on the CPU for these very inputs (the shared recipe
draws on the CPU) with FLA under the interpreter, bf16 dot operands widened exactly and fp32 accumulation (beta fed
as fp32 there: the interpreter's bf16 elementwise arithmetic is wrong): outputs within 1.6% of the largest entry,
states 0.5% (docs/perf/NOTES_gdn.md, "FLA as the native rollout"). A layout slip is off by far more (CPU, fp32: beta
= 1 instead of beta 125%, the states read in [V, K] order 48%, beta bound to the decode kernel's ``gk`` as in the
reverted c839157 NaN)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("fla")

HK, HV, D = 16, 32, 128
BOUND = 2.0**-4  # of the largest reference entry (module docstring)
# (lengths, start positions, slots) of each call: a prefill across chunk boundaries, a mixed call, three decode steps.
CALLS = [
    ([70, 5, 130], [0, 0, 0], [2, 0, 1]),
    ([9, 1, 40], [70, 5, 0], [2, 0, 3]),
    *[([1, 1, 1, 1], [79 + i, 6 + i, 130 + i, 40 + i], [2, 0, 1, 3]) for i in range(3)],
]


def _inputs(t: int, seed: int):
    """The tests' one recipe (``testing.gdn_inputs``), v in bf16 as the layer's conv leaves it (q, k come from l2norm
    in fp32; g, beta from the gates in fp32)."""
    from megatron_iso.testing.gdn_inputs import random_gdn_inputs

    q, k, v, g, beta = random_gdn_inputs(t, seed, hk=HK, hv=HV, dk=D, dv=D, device="cuda")
    return q, k, v.bfloat16(), g, beta


def _rollout(monkeypatch, use_fla: bool) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, int]]:
    """Every call's outputs, the final states of slots 0-3, and how often each FLA entry point ran."""
    from megatron_iso.ops.gdn import fla_stock, native
    from megatron_iso.ops.gdn.state_cache import GDNLayerState

    ran = {"chunk": 0, "recurrent": 0}
    if use_fla:
        chunk, recurrent = fla_stock.entry_points()

        def counted(name, fn):
            def call(*args, **kwargs):
                ran[name] += 1
                return fn(*args, **kwargs)

            return call

        monkeypatch.setattr(
            fla_stock, "entry_points", lambda: (counted("chunk", chunk), counted("recurrent", recurrent))
        )
    else:
        monkeypatch.setattr(fla_stock, "serves", lambda *a: False)
    state = GDNLayerState.allocate(
        5, conv_dim=8, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D, value_dim=D, chunk=64, device="cuda"
    )
    outs = []
    with torch.no_grad():
        for n, (lens, starts, slots) in enumerate(CALLS):
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
            outs.append(
                native.gated_delta_rule(
                    *_inputs(sum(lens), seed=n),
                    cu,
                    state=state,
                    slots=torch.tensor(slots, device="cuda"),
                    starts=torch.tensor(starts, device="cuda"),
                )
            )
    monkeypatch.undo()
    return outs, state.running[:4].clone(), ran


def _rel_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    return float((got - want).abs().max()) / float(want.abs().max())


def test_fla_rollout_matches_the_torch_native_path(monkeypatch):
    fla_out, fla_state, ran = _rollout(monkeypatch, use_fla=True)
    ref_out, ref_state, _ = _rollout(monkeypatch, use_fla=False)
    # The prefill and the mixed call's prefill rows through the chunk kernel; the mixed call's decode row and the
    # three decode steps through the fused recurrent kernel.
    assert ran == {"chunk": 2, "recurrent": 4}
    gaps = [_rel_gap(a, b) for a, b in zip(fla_out, ref_out, strict=True)]
    state_gap = _rel_gap(fla_state, ref_state)
    print(f"relative gaps: outputs {[f'{x:.2e}' for x in gaps]}, states {state_gap:.2e}")
    assert max(gaps) <= BOUND, gaps
    assert state_gap <= BOUND, state_gap
    assert float(ref_state.abs().max()) > 0.1  # the states hold history: the comparison is not of near-zeros


def test_trainer_calls_stay_on_the_torch_chunk_algorithm(monkeypatch):
    """Autograd (training) and no state cache (scoring) never reach FLA."""
    from megatron_iso.ops.gdn import fla_stock, native

    def refuse():
        raise AssertionError("a trainer call reached FLA")

    monkeypatch.setattr(fla_stock, "entry_points", refuse)
    q, k, v, g, beta = _inputs(100, seed=7)
    cu = torch.tensor([0, 60, 100], device="cuda")
    v.requires_grad_(True)
    native.gated_delta_rule(q, k, v, g, beta, cu).sum().backward()
    assert v.grad is not None
    with torch.no_grad():
        native.gated_delta_rule(q, k, v.detach(), g, beta, cu)


def test_the_cuda_entry_names_flas_kernels():
    from megatron_iso.ops.gdn import fla_stock
    from megatron_iso.registry import Profile, lookup

    impl = lookup("gated_delta_rule", "cuda", Profile.PERFORMANCE)
    assert impl.impl_for("prefill").startswith(fla_stock.FLA_CHUNK + "@fla-core-")
    assert impl.impl_for("decode").startswith(fla_stock.FLA_RECURRENT + "@fla-core-")
