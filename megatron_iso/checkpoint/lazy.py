"""An HF safetensors directory as a :class:`~megatron_iso.models.weight_source.WeightSource`: tensor names and
shapes from the file headers, bytes read with ``safe_open(...).get_slice`` only for the rows, columns or experts a
rank asks for. A run that starts from an HF directory reads each rank's shard this way, never the whole model.

Names are the text model's, as :func:`~megatron_iso.checkpoint.convert.checked_hf_weights` gives them: a
multimodal Qwen3.5's ``model.language_model.`` prefix dropped, its vision tower and MTP head left out, fused 3-D
experts seen as per-expert tensors (a view of one expert's rows, still read by slices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_iso.checkpoint.files import CheckpointFileError, open_safetensors, read_json
from megatron_iso.checkpoint.hf_dir import INDEX_FILE, SINGLE_FILE
from megatron_iso.checkpoint.names import EMBED, LM_HEAD, text_model_names
from megatron_iso.models.weight_source import WeightSource
from megatron_iso.models.weights import FUSED_DOWN, FUSED_GATE_UP


@dataclass(frozen=True)
class _Ref:
    """Where a canonical tensor lives: ``file``'s tensor ``key``, indexed by ``expert`` (a fused 3-D tensor),
    rows ``[row0, row0 + rows)`` of that (a fused gate_up's half; ``rows`` None: all)."""

    file: str
    key: str
    shape: tuple[int, ...]
    expert: int | None = None
    row0: int = 0


def _weight_files(hf_dir: Path) -> dict[str, str]:
    """Stored tensor name -> file name, from the index or the single file's header."""
    if (hf_dir / INDEX_FILE).is_file():
        index = read_json(hf_dir / INDEX_FILE)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointFileError(f"{hf_dir / INDEX_FILE}: no 'weight_map' object (tensor name -> file)")
        return dict(index["weight_map"])
    if (hf_dir / SINGLE_FILE).is_file():
        with open_safetensors(hf_dir / SINGLE_FILE) as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    if list(hf_dir.glob("*.bin")) or list(hf_dir.glob("*.pt")):
        raise ValueError(f"{hf_dir} holds pickled weights (*.bin/*.pt); only safetensors are read (no pickle)")
    raise FileNotFoundError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


class LazyHFSource(WeightSource, contextlib.AbstractContextManager):
    """The weights of an HF directory, read by slices while the source is open (``with LazyHFSource(d) as s``).

    ``hf_config``: the directory's config.json (how its tensors are named); ``tied``: the model ties its head to
    the embedding, so a stored ``lm_head.weight`` is left out here and checked rank by rank
    (:meth:`check_tied_head`), as import checks it whole."""

    def __init__(self, hf_dir: str | Path, hf_config: Mapping[str, Any], tied: bool = False) -> None:
        self.hf_dir = Path(hf_dir)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        stored = _weight_files(self.hf_dir)
        renamed, self.dropped = text_model_names(stored, hf_config)
        self.refs: dict[str, _Ref] = {}
        self.fused_experts = False
        try:
            for name in sorted(renamed):
                self._add(name, renamed[name], stored[renamed[name]], set(renamed))
        except BaseException:
            self.close()
            raise
        self.tied_head = self.refs.pop(LM_HEAD) if tied and LM_HEAD in self.refs and EMBED in self.refs else None

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(open_safetensors(self.hf_dir / file))
        return self._handles[file]

    def _add(self, name: str, key: str, file: str, names: set[str]) -> None:
        handle = self._handle(file)
        if key not in set(handle.keys()):
            raise KeyError(f"tensor '{key}' is listed in {INDEX_FILE} but missing from {file}")
        shape = tuple(handle.get_slice(key).get_shape())
        if name.endswith(FUSED_GATE_UP) and name[: -len(FUSED_GATE_UP)] + FUSED_DOWN in names:
            if len(shape) != 3 or shape[1] % 2:
                raise ValueError(f"fused expert tensor '{name}' {list(shape)} is not [E, 2F, H]")
            layer, half = name[: -len(FUSED_GATE_UP)], shape[1] // 2
            for e in range(shape[0]):
                p = f"{layer}.mlp.experts.{e}."
                self.refs[p + "gate_proj.weight"] = _Ref(file, key, (half, shape[2]), e, 0)
                self.refs[p + "up_proj.weight"] = _Ref(file, key, (half, shape[2]), e, half)
            self.fused_experts = True
        elif name.endswith(FUSED_DOWN) and name[: -len(FUSED_DOWN)] + FUSED_GATE_UP in names:
            if len(shape) != 3:
                raise ValueError(f"fused expert tensor '{name}' {list(shape)} is not [E, H, F]")
            for e in range(shape[0]):
                self.refs[f"{name[: -len(FUSED_DOWN)]}.mlp.experts.{e}.down_proj.weight"] = _Ref(
                    file, key, shape[1:], e
                )
        else:  # an unpaired fused tensor stays as stored: the model check names it as unexpected
            self.refs[name] = _Ref(file, key, shape)

    def __enter__(self) -> LazyHFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def names(self) -> Iterable[str]:
        return self.refs.keys()

    def __contains__(self, name: object) -> bool:
        return name in self.refs

    def shape(self, name: str) -> tuple[int, ...]:
        return self.refs[name].shape

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._read_ref(self.refs[name], index)

    def _read_ref(self, ref: _Ref, index: tuple[slice, ...]) -> torch.Tensor:
        handle = self._handle(ref.file)
        if ref.expert is None and not index:
            return handle.get_tensor(ref.key)
        rows = index[0] if index else slice(None)
        a = 0 if rows.start is None else rows.start
        b = ref.shape[0] if rows.stop is None else rows.stop
        full = (slice(ref.row0 + a, ref.row0 + b), *index[1:])
        return handle.get_slice(ref.key)[(ref.expert, *full) if ref.expert is not None else full]

    def check_tied_head(self, rank: int, tp: int) -> None:
        """A stored tied ``lm_head.weight`` must equal the embedding: this rank's rows of both are compared."""
        if self.tied_head is None:
            return
        rows = self.shape(EMBED)[0] // tp
        head = self._read_ref(self.tied_head, (slice(rank * rows, (rank + 1) * rows),))
        if self.tied_head.shape != self.shape(EMBED) or not torch.equal(head, self.rows(EMBED, rank, tp)):
            raise ValueError(f"tensor '{LM_HEAD}' differs from '{EMBED}' but config.json has tie_word_embeddings=true")
