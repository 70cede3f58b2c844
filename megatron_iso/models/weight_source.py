"""HF-named weights as a source of slices, so a rank's shard is read without the rest of the model.

:func:`~megatron_iso.models.weights.megatron_shard` asks a :class:`WeightSource` for whole tensors
(norms, routers, one EP rank's experts) and for one rank's block of rows or columns (everything
TP-split). :class:`DictSource` answers from tensors in memory; ``checkpoint.lazy`` answers from
safetensors files with ``get_slice``, reading only the bytes asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


class WeightSource:
    """Tensors by HF name. Subclasses implement :meth:`names`, :meth:`shape` and :meth:`_read`."""

    def names(self) -> Iterable[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` (one slice per leading dimension; the rest whole)."""
        raise NotImplementedError

    def __contains__(self, name: object) -> bool:
        return name in set(self.names())

    def full(self, name: str) -> torch.Tensor:
        return self._read(name, ())

    def rows(self, name: str, rank: int, parts: int, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Block ``rank`` of ``parts`` equal blocks of rows ``[start, start + length)`` (default: all rows)."""
        rows = self.shape(name)[0] if length is None else length
        if rows % parts:
            raise ValueError(f"tensor '{name}': {rows} rows do not split into {parts} equal blocks")
        step = rows // parts
        a = start + rank * step
        return self._read(name, (slice(a, a + step),))

    def cols(self, name: str, rank: int, parts: int) -> torch.Tensor:
        """Block ``rank`` of ``parts`` equal blocks of columns (dimension 1)."""
        cols = self.shape(name)[1]
        if cols % parts:
            raise ValueError(f"tensor '{name}': {cols} columns do not split into {parts} equal blocks")
        step = cols // parts
        return self._read(name, (slice(None), slice(rank * step, (rank + 1) * step)))


class DictSource(WeightSource):
    """A source over tensors already in memory (views: nothing is copied)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][index] if index else self.tensors[name]


def as_source(weights: Mapping[str, torch.Tensor] | WeightSource) -> WeightSource:
    return weights if isinstance(weights, WeightSource) else DictSource(weights)
