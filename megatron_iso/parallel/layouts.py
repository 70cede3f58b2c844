"""Several Megatron parallel layouts in one world (e.g. trainer TP=2 and rollout TP=1 on the same ranks).

Megatron's ``parallel_state`` holds one layout in module globals, and modules built under a layout
keep that layout's groups; code that asks ``parallel_state`` at run time (the scorer, the sampler,
the weight loader) sees whichever layout is active. A :class:`ParallelLayout` is a snapshot of those
globals: :meth:`ParallelLayout.create` initialises a second layout's process groups (collective over
the world) without disturbing the active one, and :meth:`ParallelLayout.active` switches to it for a
block. Only references move; no process group is created or destroyed by switching.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def _state_names() -> list[str]:
    """parallel_state's layout globals: ``_UPPER_CASE`` module attributes that are data, not code."""
    from megatron.core import parallel_state

    code = (types.FunctionType, types.ModuleType, type)
    return sorted(
        k for k, v in vars(parallel_state).items() if k.startswith("_") and k.isupper() and not isinstance(v, code)
    )


def _snapshot() -> dict[str, Any]:
    from megatron.core import parallel_state

    return {k: getattr(parallel_state, k) for k in _state_names()}


def _restore(state: dict[str, Any]) -> None:
    from megatron.core import parallel_state

    for k, v in state.items():
        setattr(parallel_state, k, v)


@dataclass(frozen=True)
class ParallelLayout:
    """One layout's sizes and its ``parallel_state`` globals (process groups, ranks, buffers)."""

    tp: int
    pp: int
    ep: int
    state: dict[str, Any] = field(repr=False, compare=False)
    cp: int = 1

    @classmethod
    def current(cls) -> ParallelLayout:
        """The layout ``parallel_state`` holds now."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("Megatron's parallel_state is not initialised; there is no current layout")
        return cls(
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            _snapshot(),
            parallel_state.get_context_parallel_world_size(),
        )

    @classmethod
    def create(cls, tp: int, pp: int = 1, ep: int = 1, cp: int = 1) -> ParallelLayout:
        """Initialise another layout's groups (every rank must call this, in the same order); the
        layout active before the call is active again after it."""

        from megatron_iso.parallel.world import initialize_layout

        before = cls.current()
        # Not destroy_model_parallel(): it destroys the gloo DP groups, which ``before`` still uses.
        _restore({k: type(v)() if isinstance(v, dict | list) else None for k, v in before.state.items()})
        try:
            initialize_layout(tp, pp, ep, cp=cp)
            return cls.current()
        finally:
            _restore(before.state)

    @contextlib.contextmanager
    def active(self) -> Iterator[ParallelLayout]:
        """Make this layout ``parallel_state``'s for the block, then put the previous one back."""
        before = _snapshot()
        _restore(self.state)
        try:
            yield self
        finally:
            _restore(before)
