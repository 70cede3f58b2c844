"""FLA's rollout path of the performance profile (``ops.gdn.fla_stock.rollout_rule``) against the torch native path,
on the CPU under TRITON_INTERPRET=1, fp32 (the interpreter's bf16 ``tl.dot`` is wrong). Run by
``test_gdn_fla_interpret.py`` in a child process; prints ``fla rollout ok`` and the largest gaps.

Four calls, each on both paths with their own state caches and the same slots: a packed prefill of fresh sequences
(FLA's chunk kernel over the whole call), a mixed call (a resumed sequence continuing with 9 tokens, a decode step
and a fresh sequence in a new slot: the chunk kernel on two sequences, one from its slot's state, one from zeros, the
fused recurrent kernel on the third), then two steps of decode only (the fused recurrent kernel over the whole call).
Dk != Dv, so a state stored the other way round ([V, K]) cannot pass, and Hv = 2 Hk checks FLA's grouping of value
heads. Every call's outputs and the final states of its slots are held to the torch path's within ``BOUND``.

Bound: both paths compute in fp32 (unit roundoff u = 2^-24) and sum the same terms in a different order through at
most four chained stages (the decay cumsum, the triangular inverse, the w / u products, the state and output
products), each of at most C + Dk = 32 terms; the first-order worst case, 4 * 32 * u = 2^-17 of the magnitudes
involved, doubled: 2^-16 of the largest reference entry (measured: 1.0e-6). A layout slip moves results by a large
fraction of that entry, thousands of times the bound (measured: beta = 1 instead of beta 125%, the slots' states
read in [V, K] order 48%, beta bound to the decode kernel's ``gk`` as in the reverted c839157 NaN).
"""

from __future__ import annotations

import torch

from megatron_iso.testing.triton_interpret import (
    allow_runtime_loop_bounds,
    skip_autotune_benchmarks,
    tensor_loop_indices,
)

allow_runtime_loop_bounds()
skip_autotune_benchmarks()

import fla.ops.common.chunk_delta_h as chunk_delta_h  # noqa: E402  (after the interpreter patches)

tensor_loop_indices(chunk_delta_h)

from megatron_iso.ops.gdn import fla_stock, native  # noqa: E402
from megatron_iso.ops.gdn.state_cache import GDNLayerState  # noqa: E402
from megatron_iso.testing.gdn_inputs import random_gdn_inputs  # noqa: E402

HK, HV, DK, DV, CHUNK = 2, 4, 16, 32, 16
BOUND = 2.0**-16  # of the largest reference entry (module docstring)


def _state() -> GDNLayerState:
    return GDNLayerState.allocate(
        5, conv_dim=8, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=DK, value_dim=DV, chunk=CHUNK
    )


def _gap(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}")
    gap, top = float((got - want).abs().max()), float(want.abs().max())
    if not gap <= BOUND * top:
        raise AssertionError(f"{what}: max |fla - torch| = {gap:.3g} > {BOUND:.3g} * {top:.3g}")
    return gap / top


def main() -> None:
    scale = DK**-0.5
    fla_state, torch_state = _state(), _state()
    # (lengths, start positions, slots) of each call; slot 4 never used (it stays zero on both sides).
    calls = [
        ([23, 5, 12], [0, 0, 0], [2, 0, 1]),
        ([9, 1, 17], [23, 5, 0], [2, 0, 3]),
        ([1, 1, 1, 1], [32, 6, 12, 17], [2, 0, 1, 3]),
        ([1, 1, 1, 1], [33, 7, 13, 18], [2, 0, 1, 3]),
    ]
    worst = {"out": 0.0, "state": 0.0}
    for n, (lens, starts, slots) in enumerate(calls):
        q, k, v, g, beta = random_gdn_inputs(sum(lens), n, hk=HK, hv=HV, dk=DK, dv=DV)
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
        cu_t, st_t, slots_t = torch.tensor(cu), torch.tensor(starts), torch.tensor(slots)
        want = native.gated_delta_rule(
            q, k, v, g, beta, cu_t, scale=scale, chunk=CHUNK, state=torch_state, slots=slots_t, starts=st_t
        )
        got = fla_stock.rollout_rule(
            q, k, v, g, beta, cu_t, cu, starts, scale=scale, state=fla_state, slots=slots_t, chunk_size=CHUNK
        )
        worst["out"] = max(worst["out"], _gap(got, want, f"call {n}: outputs"))
        for s in slots:
            gap = _gap(fla_state.running[s], torch_state.running[s], f"call {n}: final state of slot {s}")
            worst["state"] = max(worst["state"], gap)
    if not torch.equal(fla_state.running[4], torch.zeros_like(fla_state.running[4])):
        raise AssertionError("slot 4 was never used but FLA's path wrote it")
    print(f"fla rollout ok: outputs {worst['out']:.3g}, states {worst['state']:.3g} of the largest entry")


if __name__ == "__main__":
    main()
