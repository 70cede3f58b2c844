"""Every CPU probe (the inputs whose output digests the lockfile pins) draws from its own seeded generator: its
outputs do not follow the global RNG, so a lockfile's digests do not depend on what ran before the probe."""

from __future__ import annotations

import torch

from megatron_iso.contract.loader import load_op_implementations
from megatron_iso.registry import registered


def _outputs(impl) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in impl.probe().items() if isinstance(v, torch.Tensor)}


def test_cpu_probes_do_not_follow_the_global_rng():
    load_op_implementations()
    impls = [i for i in registered("cpu") if i.probe is not None]
    assert impls
    for impl in impls:
        torch.manual_seed(1)
        first = _outputs(impl)
        torch.manual_seed(2)
        torch.randn(97)
        second = _outputs(impl)
        assert first.keys() == second.keys(), impl.impl_id
        for name in first:
            a, b = first[name], second[name]
            same = (
                torch.equal(a, b)
                if not a.is_floating_point()
                else torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            )
            assert same, f"{impl.impl_id}: probe output {name!r} changes with the global RNG"
