"""The GDN layers' shared host-side cache: a hit only for the very same tensors, unchanged."""

from __future__ import annotations

import torch

from megatron_iso.ops.common.tensor_keyed_cache import TensorKeyedCache


def test_hits_by_identity_and_version_only() -> None:
    cache: TensorKeyedCache[list[int]] = TensorKeyedCache(2)
    builds: list[int] = []

    def build(t: torch.Tensor):
        return lambda: builds.append(1) or t.tolist()

    a, b = torch.tensor([0, 3, 5]), torch.tensor([0, 3, 5])
    assert cache.get((a, None), "x", build(a)) == [0, 3, 5]
    assert cache.get((a, None), "x", build(a)) == [0, 3, 5] and len(builds) == 1  # same tensors: a hit
    cache.get((b, None), "x", build(b))  # equal values, another tensor: a miss
    cache.get((a, None), "y", build(a))  # another extra: a miss
    assert len(builds) == 3
    a[1] = 4  # in place: the version counter moves
    assert cache.get((a, None), "y", build(a)) == [0, 4, 5] and len(builds) == 4
    cache.get((b, None), "x", build(b))  # evicted (size 2): rebuilt
    assert len(builds) == 5
    cache.clear()
    cache.get((a, None), "y", build(a))
    assert len(builds) == 6
