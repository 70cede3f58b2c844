"""Count, on CPU, the reads that a CUDA run turns into device-to-host syncs.

On a CPU run every tensor is a host tensor: ``.tolist()``, ``.item()`` or ``bool(t)`` cost nothing
and look like any other call. On CUDA a read of a *device* tensor blocks the host until the GPU
has caught up, which makes the host wait once per read and keeps the step out of a CUDA graph.
:class:`HostReadCounter` tells the two apart by provenance: a tensor is "on the device" when the
caller seeded it (model parameters, caches), when ``Tensor.to`` / a factory (``torch.zeros``,
``torch.tensor``, ...) was called with an explicit device, or when an ATen op computed it from a
tensor on the device (propagated under a ``TorchDispatchMode``). Each read of such a tensor is
recorded with the innermost ``megatron_iso`` frame that made it:

- a scalar read (``item``/``bool``/``int``/``float``/indexing by a 0-d tensor: ``_local_scalar_dense``;
  any op of device tensors that returns a Python number, e.g. ``torch.equal``);
- ``tolist``/``numpy``/``cpu``, and a ``copy_`` from a device tensor into a host one (one made by a
  Python factory call without a device);
- an op whose output size depends on the data (``nonzero``, boolean indexing, ``masked_select``,
  ``unique``, ``repeat_interleave`` without ``output_size``): on CUDA those read a count back.

Blind spot: ``x.to("cpu")`` counts as an upload (a CPU run cannot tell ``"cpu"`` from the
engine's device); the decode path never calls it. Host tensors that reach a factory's
``device=`` as ``device=host_tensor.device`` would count as device tensors (none in the step).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_aten = torch.ops.aten
# Ops whose output shape is read back from the device on CUDA (a hidden sync).
_DATA_DEPENDENT = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}
_FACTORIES = ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "randn", "rand", "randint")
_READ_METHODS = ("tolist", "numpy", "cpu", "__array__")


@dataclass(frozen=True)
class HostRead:
    kind: str  # "item", "tolist", "copy_to_host", "data_dependent:<op>", ...
    where: str  # "megatron_iso/<file>.py:<line> (<function>)"


def _caller() -> str:
    # The innermost frame of the package (not this module); else the innermost non-torch frame.
    f = sys._getframe(2)
    fallback = None
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("testing/host_reads.py"):
            if "/megatron_iso/" in name:
                tail = name[name.rindex("/megatron_iso/") + 1 :]
                return f"{tail}:{f.f_lineno} ({f.f_code.co_name})"
            fallback = fallback or f"{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return fallback or "?"


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class HostReadCounter(TorchDispatchMode):
    """Context manager: track device tensors and record every host read of one.

    ``seed(...)`` marks tensors (or a module's parameters and buffers) as device tensors;
    ``reads`` lists what was read since the last ``clear()``; ``summary()`` counts them by kind
    and place. Tracking is always on inside the context; ``clear()`` only resets the record.
    """

    def __init__(self) -> None:
        super().__init__()
        self._device = WeakIdKeyDictionary()
        # Tensors made on the host on purpose (a Python factory call without a device, a download):
        # a copy into one of them from a device tensor is a download. A tensor that ATen makes
        # inside a composite op (pad_sequence's output) is neither; a copy into it stays on the device.
        self._host = WeakIdKeyDictionary()
        self.reads: list[HostRead] = []
        self._saved: list[tuple[object, str, object]] = []

    # --- tracking ------------------------------------------------------------------------------
    def seed(self, *items: torch.Tensor | torch.nn.Module | Iterable[torch.Tensor]) -> None:
        for item in items:
            if isinstance(item, torch.nn.Module):
                self.seed(*item.parameters(), *item.buffers())
            elif isinstance(item, torch.Tensor):
                self._device[item] = True
            else:
                self.seed(*item)

    def on_device(self, t: torch.Tensor) -> bool:
        return t in self._device

    def clear(self) -> None:
        self.reads = []

    def summary(self) -> dict[tuple[str, str], int]:
        """(kind, where) -> count, in first-seen order."""
        return dict(collections.Counter((r.kind, r.where) for r in self.reads))

    def _record(self, kind: str) -> None:
        self.reads.append(HostRead(kind, _caller()))

    # --- ATen level: propagation, scalar reads, data-dependent shapes -------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        dev_in = [t for t in inputs if t in self._device]
        if dev_in:
            if func is _aten.copy_.default and args[1] in self._device and args[0] in self._host:
                self._record("copy_to_host")
            elif func in _DATA_DEPENDENT or (
                func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
            ):
                self._record(f"data_dependent:{func.overloadpacket.__name__}")
            elif func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default) and any(
                t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])
            ):
                self._record(f"boolean_index:{func.overloadpacket.__name__}")
        out = func(*args, **kwargs)
        if dev_in:
            if func is _aten._local_scalar_dense.default:
                self._record("item")
            elif isinstance(out, bool | int | float):
                self._record(f"scalar:{func.overloadpacket.__name__}")
            # Outputs, and tensors written in place (a view's base too: pad_sequence fills slices
            # of a buffer ATen made) hold device values from now on.
            written = [
                a
                for a, spec in zip(args, func._schema.arguments, strict=False)
                if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write
            ]
            for t in (*_tensors(out), *written, *(w._base for w in written if w._base is not None)):
                if t not in self._host:  # a download's destination stays a host tensor
                    self._device[t] = True
        return out

    # --- Python level: reads and uploads that never reach the dispatcher on CPU ---------------
    def _patch(self, owner: object, name: str, wrapper_for) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper_for(original))

    def __enter__(self):
        counter = self

        def reader(name: str):
            def wrap(original):
                def read(t, *a, **k):
                    if t in counter._device:
                        counter._record(name)
                    return original(t, *a, **k)

                return read

            return wrap

        def upload(original):
            def to(t, *a, **k):
                out = original(t, *a, **k)
                target = k.get("device", a[0] if a else None)
                if isinstance(target, str | torch.device) or (
                    isinstance(target, torch.Tensor) and target in counter._device
                ):
                    if out is t and t not in counter._device:
                        # An upload makes a new tensor; on CPU ``to`` returns its input, which
                        # stays a host tensor (reading it afterwards is not a device read).
                        out = t.clone()
                    counter._device[out] = True
                return out

            return to

        def factory(original):
            def make(*a, **k):
                out = original(*a, **k)
                (counter._device if k.get("device") is not None else counter._host)[out] = True
                return out

            return make

        def download(original):
            def cpu(t, *a, **k):
                if t not in counter._device:
                    return original(t, *a, **k)
                counter._record("cpu")
                # A real download is a host copy: untracked, so reading it is not a second read.
                out = original(t, *a, **k).clone()
                del counter._device[out]
                counter._host[out] = True
                return out

            return cpu

        for name in _READ_METHODS:
            self._patch(torch.Tensor, name, download if name == "cpu" else reader(name))
        self._patch(torch.Tensor, "to", upload)
        for name in _FACTORIES:
            self._patch(torch, name, factory)
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
