"""``model.init_from``: start a run from a real checkpoint instead of seeded random weights.

The value names an HF model directory (``config.json`` + safetensors), a megatron_iso checkpoint written by
``iso-convert import`` (``iso_checkpoint.json``), a run's checkpoint (``runs/x/checkpoints/step_N``) or a run
directory (its latest checkpoint). The checkpoint decides the model: :func:`apply_init_from` replaces the ``model``
group by the one the checkpoint describes (``model.KEY=VALUE`` overrides on the command line still apply on top),
and points a task whose ``task.tokenizer`` is null at the tokenizer of the directory the checkpoint came from (an
HF directory's own; a run checkpoint's: its run's source). :func:`build_initial_model` then loads each rank's shard: from an HF directory by safetensors slices (a
rank reads its own rows, columns and experts, never the whole model), from the two other kinds the files of the
rank's own TP / EP position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_iso.checkpoint import iso_format
from megatron_iso.checkpoint.files import CheckpointFileError, open_safetensors, read_json
from megatron_iso.checkpoint.hf_config import HF_CONFIG_FILE, model_config_from_hf, read_hf_config
from megatron_iso.checkpoint.lazy import LazyHFSource
from megatron_iso.checkpoint.run_ckpt import (
    _source_dir,
    is_dist_checkpoint,
    is_run_checkpoint,
    load_run_weights,
    position_shard,
    read_meta,
    run_layout,
    verify_run_checkpoint,
)
from megatron_iso.errors import UserError, check_finite
from megatron_iso.models.transformer_config import IsoTransformerConfig
from megatron_iso.models.weights import hf_shapes, is_expert_param, load_hf_state_dict
from megatron_iso.settings.compose import replace_model

FIELD = "model.init_from"
KINDS = {
    "hf": "an HF model directory (config.json + *.safetensors)",
    "iso": f"a megatron_iso checkpoint ({iso_format.MANIFEST}, from iso-convert import)",
    "run": "a run checkpoint (runs/<run>/checkpoints/step_N) or a run directory",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# task.tokenizer values that mean "the checkpoint's" (rl.tasks reads null so): a run checkpoint's is its source's.
DEFAULT_TOKENIZERS = (None, "")


class InitFromError(UserError, ValueError):
    """``model.init_from`` names nothing a run can start from; the message names the field and the kinds allowed."""


@dataclass(frozen=True)
class InitSource:
    kind: str  # one of KINDS
    path: Path  # absolute; for "run" the checkpoint directory itself


def _allowed() -> str:
    return "; allowed: " + ", ".join(KINDS.values())


def locate(value: Any) -> InitSource:
    """What ``model.init_from=value`` names; an :class:`InitFromError` naming the field when it names nothing usable."""
    if not isinstance(value, str | Path) or not str(value).strip():
        raise InitFromError(f"{FIELD}={value!r} is not a directory path{_allowed()}")
    path = Path(value).expanduser().resolve()
    if not path.exists():
        raise InitFromError(f"{FIELD}={str(value)!r}: no such directory ({path}){_allowed()}")
    if not path.is_dir():
        raise InitFromError(f"{FIELD}={str(value)!r}: {path} is a file, not a directory{_allowed()}")
    pointer = path / "checkpoints" / "latest"
    if pointer.is_file():  # a run directory: its latest checkpoint
        path = path / "checkpoints" / pointer.read_text().strip()
    if is_run_checkpoint(path):
        return InitSource("run", path)
    if (path / iso_format.MANIFEST).is_file():
        return InitSource("iso", path)
    if (path / HF_CONFIG_FILE).is_file():
        return InitSource("hf", path)
    raise InitFromError(f"{FIELD}={str(value)!r}: {path} holds no checkpoint{_allowed()}")


def checkpoint_model(source: InitSource) -> dict[str, Any]:
    """The ``model`` group the checkpoint describes (its config.json, import manifest or run identity)."""
    try:
        if source.kind == "hf":
            return model_config_from_hf(read_hf_config(source.path), name=source.path.name)
        if source.kind == "iso":
            return dict(iso_format.read_manifest(source.path)["model"])
        return dict(read_meta(source.path)["identity"]["model"])
    except (OSError, KeyError, ValueError) as exc:
        raise InitFromError(f"{FIELD}={source.path}: {exc}") from exc


def _command_line_overrides() -> list[str]:
    """The Hydra app's command-line overrides (none outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def model_overrides(overrides: Sequence[str]) -> list[str]:
    """The ``model.KEY=VALUE`` overrides among ``overrides`` (``model.init_from`` itself excluded)."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        if key.startswith("model.") and key != FIELD and not o.startswith("~"):
            out.append(o.lstrip("+"))
    return out


@dataclass(frozen=True)
class InitAssets:
    """What a run needs from the checkpoint besides weights: its tokenizer's directory (None: it ships none) and
    the token ids that end a response (generation_config.json's ``eos_token_id``, else config.json's)."""

    tokenizer_dir: Path | None
    eos_token_ids: tuple[int, ...]


def _eos_ids(directory: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", HF_CONFIG_FILE):
        if not (directory / name).is_file():
            continue
        found = read_json(directory / name)
        if not isinstance(found, dict):
            continue
        value = found.get("eos_token_id", (found.get("text_config") or {}).get("eos_token_id"))
        if value is not None:
            return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
    return ()


def init_assets(init_from: Any) -> InitAssets:
    """The tokenizer directory and EOS ids of ``model.init_from`` (a run checkpoint's: those of the directory its
    run started from); empty for a run without ``init_from``."""
    if init_from in (None, ""):
        return InitAssets(None, ())
    source = locate(init_from)
    directory = _source_dir({"init_from": str(source.path)}) if source.kind == "run" else source.path
    if directory is None:
        return InitAssets(None, ())
    has_tokenizer = any((directory / name).is_file() for name in TOKENIZER_FILES)
    return InitAssets(directory if has_tokenizer else None, _eos_ids(directory))


def apply_init_from(cfg: Mapping[str, Any], overrides: Sequence[str] | None = None) -> Mapping[str, Any]:
    """``cfg`` with its ``model`` group read from ``model.init_from`` (a copy; ``cfg`` itself when it is unset).

    ``overrides``: the ``model.KEY=VALUE`` overrides to apply on top of the checkpoint's model (default: the
    Hydra app's command line). A task whose ``task.tokenizer`` is null gets the checkpoint's tokenizer directory
    when there is one."""
    value = cfg["model"].get("init_from") if "model" in cfg else None
    if value in (None, ""):
        return cfg
    source = locate(value)
    model = {**checkpoint_model(source), "init_from": str(source.path)}
    given = model_overrides(_command_line_overrides() if overrides is None else overrides)
    tokenizer = init_assets(source.path).tokenizer_dir
    return replace_model(cfg, model, given, None if tokenizer is None else str(tokenizer), DEFAULT_TOKENIZERS)


def _read_files(files: Sequence[tuple[Path, bool | None]]) -> dict[str, torch.Tensor]:
    """Tensors of safetensors files; each file's experts only (True), all but its experts (False), or all (None)."""
    out: dict[str, torch.Tensor] = {}
    for path, experts in files:
        with open_safetensors(path) as f:
            names = list(f.keys())
            out |= {n: f.get_tensor(n) for n in names if experts is None or is_expert_param(n) == experts}
    return out


def _copy_into(model: torch.nn.Module, shard: Mapping[str, torch.Tensor], where: str) -> None:
    params = dict(model.named_parameters())
    if set(shard) != set(params):
        differ = sorted(set(shard) ^ set(params))
        raise InitFromError(f"{FIELD}={where}: its parameter names differ from this model's: {differ[:5]}")
    shapes = [
        f"{n} {list(t.shape)} (model {list(params[n].shape)})" for n, t in shard.items() if t.shape != params[n].shape
    ]
    if shapes:
        raise InitFromError(f"{FIELD}={where}: tensors of other shapes than this model's: {', '.join(shapes[:3])}")
    check_finite(shard.items(), f"{FIELD}={where}")
    with torch.no_grad():
        for name, tensor in shard.items():
            params[name].copy_(tensor)


def _same_layout(source: InitSource, saved: tuple[int, int], here: tuple[int, int]) -> None:
    if saved != here:
        raise InitFromError(
            f"{FIELD}={source.path}: written at tp={saved[0]}, ep={saved[1]}; this run has parallel.tp={here[0]}, "
            f"parallel.ep={here[1]}. Export it (iso-convert export --ckpt {source.path} --out DIR) and start from the "
            "HF directory, which loads at any layout"
        )


def load_initial_weights(model: torch.nn.Module, tc: IsoTransformerConfig, init_from: Any) -> None:
    """Load this rank's shard of ``model.init_from`` into ``model`` (its TP / EP rank from Megatron's parallel_state)."""
    from megatron.core import parallel_state as ps

    source = locate(init_from)
    if source.kind != "hf" and tc.pipeline_model_parallel_size > 1:  # their rank files are PP 1 ranks
        raise InitFromError(
            f"{FIELD}={source.path}: parallel.pp > 1 starts from an HF directory only, not a {source.kind} one"
        )
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    if source.kind == "hf":
        with LazyHFSource(source.path, read_hf_config(source.path), tied=tc.tie_word_embeddings) as weights:
            unexpected = sorted(set(weights.names()) - set(hf_shapes(tc)))
            if unexpected:
                raise InitFromError(
                    f"{FIELD}={source.path}: unexpected tensors {unexpected[:5]} this model does not have"
                )
            weights.check_tied_head(tp_rank, tp)
            load_hf_state_dict(model, weights, tc)
        return
    if source.kind == "iso":
        manifest = iso_format.read_manifest(source.path)
        _same_layout(source, iso_format.checkpoint_layout(manifest), (tp, ep))
        files = [(source.path / iso_format.rank_file(tp_rank, tp), False if tc.num_moe_experts else None)]
        if tc.num_moe_experts:
            files.append((source.path / iso_format.expert_file(ep_rank, ep), True))
        _copy_into(model, _read_files(files), str(source.path))
        return
    try:  # every file as saved (its recorded SHA-256), before any is read
        verify_run_checkpoint(source.path, lambda p: f"start from it instead: {FIELD}={p}")
    except CheckpointFileError as exc:
        raise InitFromError(f"{FIELD}={source.path}: {exc}") from None
    if is_dist_checkpoint(source.path):  # reshardable: each rank reads its slices at this run's layout
        load_run_weights(source.path, model)
        return
    layout = run_layout(source.path, read_meta(source.path))
    _same_layout(source, (layout.tp, layout.ep), (tp, ep))
    _copy_into(model, position_shard(source.path, layout, tp_rank, ep_rank), str(source.path))


def build_initial_model(tc: IsoTransformerConfig, init_from: Any, seed: int) -> torch.nn.Module:
    """This rank's model: from ``model.init_from`` when set, else from seeded random HF weights."""
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.weights import random_hf_state_dict

    if init_from in (None, ""):
        return build_model(tc, random_hf_state_dict(tc, seed=seed))
    model = build_model(tc)
    load_initial_weights(model, tc, init_from)
    return model
