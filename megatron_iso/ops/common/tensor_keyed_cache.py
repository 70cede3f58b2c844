"""A few recent host-side values keyed by the tensors they were derived from.

Every attention and GDN layer of a forward (and its backward) receives the same layout tensors
(``cu_seqlens``, start positions, slots). Reading them back is a host sync on a GPU, and planning from
them is host work, so the first layer does it and the others reuse the result. An entry holds the key tensors themselves: they are
compared by identity, so a freed tensor's reused id cannot match while the entry lives. Their version
counters are part of the stamp, so an in-place change is a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class TensorKeyedCache(Generic[T]):
    """The last ``size`` values, newest first, keyed by (tensors by identity and version, extras)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: list[tuple[tuple[torch.Tensor | None, ...], tuple, T]] = []

    def get(self, tensors: tuple[torch.Tensor | None, ...], extra: Hashable, build: Callable[[], T]) -> T:
        """The value built for these tensors and ``extra``, building (and keeping) it on a miss."""
        stamp = (tuple(None if t is None else t._version for t in tensors), extra)
        for key, seen, value in self._entries:
            if seen == stamp and all(a is b for a, b in zip(key, tensors, strict=True)):
                return value
        value = build()
        self._entries.insert(0, (tensors, stamp, value))
        del self._entries[self.size :]
        return value

    def clear(self) -> None:
        self._entries.clear()
