"""A training run's own checkpoints (``<run>/checkpoints/step_N``, written by ``rl.checkpoint``) read as model
weights: exported as an HF directory (``iso-convert export``, ``rl.save_hf_every``), or loaded as the start of
another run (``model.init_from``).

Two formats. The current one (``meta.json`` ``format`` = :data:`DIST_FORMAT`) is a Megatron-Core
``dist_checkpointing`` directory: every tensor under its global name and shape, read at any layout by loading it
into a model's ``sharded_state_dict`` (:func:`load_run_weights`; the export loads it into a TP 1 model). The
earlier per-rank format holds one ``model_rank<r>.safetensors`` per global rank (that rank's Megatron parameters)
and a ``meta.json`` with the layout (``tp``, ``world_size``) and the run's model group (``identity.model``); it is
still read here (and ``rl.save_hf_every`` stages its ranks in it). Which TP / EP position a global rank held follows
Megatron's rank order (``tp-cp-ep-dp-pp``, expert TP 1); the EP degree is read from how many experts a rank file
holds. Data-parallel replicas hold copies: one rank per position is read.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_iso.checkpoint.files import CheckpointFileError, open_safetensors, read_json, write_json
from megatron_iso.checkpoint.hf_config import hf_config_from_model, read_hf_config
from megatron_iso.checkpoint.hf_dir import write_hf_dir
from megatron_iso.checkpoint.integrity import IntegrityError, offer_previous, verify_checksums
from megatron_iso.checkpoint.tokenizer import copy_assets
from megatron_iso.models.transformer_config import IsoTransformerConfig, transformer_config
from megatron_iso.models.weights import EXPERT_PARAM, fuse_experts, hf_from_megatron_shards
from megatron_iso.settings import settings_with_model

META = "meta.json"
RANK_FILE = "model_rank{}.safetensors"
LEGACY_RANK_FILE = RANK_FILE  # the per-rank run checkpoint format's weight files
# meta.json "format" of a run checkpoint written through Megatron-Core's dist_checkpointing (rl.checkpoint).
DIST_FORMAT = "megatron_iso.run/dist_checkpointing-torch_dist-1"
# What reading a damaged or foreign dist checkpoint raises: many types, and torch.distributed.checkpoint's
# CheckpointException is a BaseException.
READ_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)
# HF config.json fields about tokens, not the model's arithmetic: carried over from the directory a run started from.
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "tokenizer_class")
_LOCAL_EXPERT = re.compile(r"^decoder\.layers\.\d+\.mlp\.experts\.local_experts\.(\d+)\.")


def is_dist_checkpoint(path: str | Path) -> bool:
    """A run checkpoint in the reshardable format (``rl.checkpoint``)."""
    path = Path(path)
    if not (path / META).is_file():
        return False
    try:
        meta = read_json(path / META)
    except CheckpointFileError:
        return False
    return isinstance(meta, dict) and meta.get("format") == DIST_FORMAT


def is_run_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return is_dist_checkpoint(path) or ((path / META).is_file() and (path / RANK_FILE.format(0)).is_file())


def dist_backend() -> Any:
    """The save strategy of run checkpoints: Megatron's ``torch_dist`` format (torch.distributed.checkpoint files,
    read back by Megatron's own loader), written by this process."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        """Megatron's own torch_dist writer hands the files to a spawned manager and one forked process per file
        (built for asynchronous saves on GPUs); a rank of a daemonic launcher may not start processes, and a
        synchronous save gains nothing from them. The same translation of Megatron's sharded tensors, the same
        planner, torch's synchronous writer: the same format."""

        def save(self, sharded_state_dict: dict, checkpoint_dir: Path) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            planner = MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            )
            writer = FileSystemWriter(checkpoint_dir, thread_count=1)
            dcp_save(mcore_to_pyt_state_dict(state, False), storage_writer=writer, planner=planner)

    return InProcessTorchDistSave("torch_dist", 1)


def sharded_metadata() -> dict[str, Any]:
    """What ``sharded_state_dict`` is asked for, as Megatron-LM's training checkpoints ask: the distributed optimizer
    in its ``fully_reshardable`` form (its state per parameter, like a replicated optimizer's, so TP, DP and PP may
    all change; Megatron's ``dp_reshardable`` would tie it to the TP / PP layout), one shard per tensor per rank,
    chained optimizers' keys without a per-chain prefix (they depend on the parameters, not on the chain). Without
    CUDA the distributed optimizer's state is gathered over gloo to DP rank 0 (Megatron's memory-efficient form;
    its other form all-gathers on the GPU); both read back the same."""
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available(),
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }


@contextlib.contextmanager
def quiet_dist_checkpointing() -> Iterator[None]:
    """Megatron's torch_dist strategies still go through torch's ShardedTensor and ``load_state_dict``, which warn of
    their deprecation on every call: known, and nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=FutureWarning, message=r".*(DTensor instead|load_state_dict` is deprec)"
        )
        warnings.filterwarnings("ignore", category=UserWarning, message=r"torch\.distributed is disabled")
        yield


def checkpoint_tensors(ckpt_dir: str | Path, *, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor a reshardable run checkpoint stores, whole, under its global key (the model's; with
    ``optimizer`` the optimizer's too, keys ``optimizer.*``), read by torch.distributed.checkpoint in this process
    alone. Split tensors appear as Megatron stores them (a layer axis first where the layers are alike; GDN's
    in_proj in parts): the layout-independent form, for comparing checkpoints bit for bit."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(ckpt_dir))
    stored = reader.read_metadata().state_dict_metadata
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in stored.items()
        if isinstance(m, TensorStorageMetadata) and (optimizer or not k.startswith("optimizer."))
    }
    with quiet_dist_checkpointing():
        dcp_load(out, storage_reader=reader, no_dist=True)
    return out


def load_run_weights(ckpt_dir: str | Path, model: torch.nn.Module) -> None:
    """Load a reshardable run checkpoint's weights into ``model`` at its own layout (a collective over the world
    ``model`` was built in): each rank reads its slices, stored bits unchanged. The optimizer state is not read."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_iso.errors import check_finite

    state = {"model": model.sharded_state_dict(metadata=sharded_metadata())}
    try:
        with quiet_dist_checkpointing():
            loaded = dist_checkpointing.load(state, str(ckpt_dir), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except READ_ERRORS as exc:  # a damaged or foreign shard file raises one of many types; the file is what matters
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointFileError(f"{ckpt_dir}: cannot load its weights: {first}") from None
    check_finite(((k, t) for k, t in loaded["model"].items() if isinstance(t, torch.Tensor)), f"checkpoint {ckpt_dir}")
    model.load_state_dict(loaded["model"])


def _dist_tp1_shard(ckpt_dir: Path, tc: IsoTransformerConfig) -> dict[str, torch.Tensor]:
    """The weights of a reshardable run checkpoint as one TP 1 / EP 1 rank's Megatron parameters: loaded into a TP 1
    model in a world of one process of its own (Megatron resolves every split and stacked tensor)."""
    from megatron_iso.models.gpt import build_model
    from megatron_iso.parallel.world import single_process_world

    if dist.is_initialized():
        raise CheckpointFileError(
            f"{ckpt_dir}: exporting a reshardable run checkpoint needs a process of its own (torch.distributed is "
            "already initialised here); run iso-convert export --ckpt"
        )
    with single_process_world():
        model = build_model(tc)
        load_run_weights(ckpt_dir, model)
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@dataclass(frozen=True)
class RunLayout:
    """A run checkpoint's layout: TP and EP degrees, world size, and the global rank whose file is read for each TP
    rank's (non-expert) parameters and each EP rank's experts (the lowest of its data-parallel copies)."""

    tp: int
    ep: int
    world_size: int
    tp_owner: dict[int, int]
    ep_owner: dict[int, int]

    def writers(self) -> set[int]:
        return set(self.tp_owner.values()) | set(self.ep_owner.values())


def rank_layout(world_size: int, tp: int, ep: int) -> RunLayout:
    """Which global rank holds each TP rank and EP rank, in Megatron's default rank order."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    if world_size % tp or world_size % ep:
        raise ValueError(f"world size {world_size} does not split into tp={tp} and ep={ep}")
    tp_groups = RankGenerator(tp=tp, ep=1, dp=world_size // tp, pp=1, cp=1, order=order).get_ranks("tp")
    ep_groups = RankGenerator(tp=1, ep=ep, dp=world_size // ep, pp=1, cp=1, order=order).get_ranks("ep")
    tp_owner: dict[int, int] = {}
    ep_owner: dict[int, int] = {}
    for groups, owner in ((tp_groups, tp_owner), (ep_groups, ep_owner)):
        for group in groups:
            for position, r in enumerate(group):
                owner[position] = min(owner.get(position, r), r)
    return RunLayout(tp, ep, world_size, tp_owner, ep_owner)


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / META
    meta = read_json(path)
    model = (meta.get("identity") or {}).get("model") if isinstance(meta, dict) else None
    if (
        not isinstance(model, dict)
        or not isinstance(meta.get("tp"), int)
        or not isinstance(meta.get("world_size"), int)
    ):
        raise CheckpointFileError(f"{path}: not a run checkpoint's meta.json (needs tp, world_size, identity.model)")
    return meta


def run_layout(ckpt_dir: str | Path, meta: Mapping[str, Any]) -> RunLayout:
    if int(meta.get("pp", 1)) != 1:  # its rank files hold pipeline stages under stage names (models.stages)
        raise CheckpointFileError(f"{ckpt_dir}: written with parallel.pp={meta['pp']}; reading stages is not built yet")
    tp, world = int(meta["tp"]), int(meta["world_size"])
    model = meta["identity"]["model"]
    ep = 1
    if model.get("num_experts"):
        with open_safetensors(Path(ckpt_dir) / RANK_FILE.format(0)) as f:
            names = list(f.keys())
        local = {m.group(1) for k in names if (m := _LOCAL_EXPERT.match(k)) and k.startswith("decoder.layers.0.")}
        ep = int(model["num_experts"]) // max(1, len(local))
    return rank_layout(world, tp, ep)


def run_model_config(model: Mapping[str, Any], tp: int, ep: int) -> IsoTransformerConfig:
    return transformer_config(settings_with_model(model, [f"parallel.tp={tp}", f"parallel.ep={ep}"]))


def read_rank_file(ckpt_dir: str | Path, rank: int, experts: bool | None = None) -> dict[str, torch.Tensor]:
    """A rank file's tensors: all, or only its experts (``experts=True``) or only the others (``False``)."""
    path = Path(ckpt_dir) / RANK_FILE.format(rank)
    if not path.is_file():
        raise CheckpointFileError(f"{path}: no such file (the checkpoint's meta.json names a world it lacks)")
    with open_safetensors(path) as f:
        names = list(f.keys())
        return {n: f.get_tensor(n) for n in names if experts is None or (EXPERT_PARAM in n) == experts}


def position_shard(ckpt_dir: str | Path, layout: RunLayout, tp_rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """The Megatron parameters of position (tp_rank, ep_rank): its TP rank's non-expert ones, its EP rank's experts."""
    shard = read_rank_file(ckpt_dir, layout.tp_owner[tp_rank], experts=False if layout.ep > 1 else None)
    if layout.ep > 1:
        shard |= read_rank_file(ckpt_dir, layout.ep_owner[ep_rank], experts=True)
    return shard


def _source_dir(model: Mapping[str, Any]) -> Path | None:
    """The directory a run's weights started from (``model.init_from``), followed through run checkpoints back to
    the HF directory or import that holds the tokenizer and config.json; None when there is none any more."""
    seen: set[Path] = set()
    path = model.get("init_from")
    while path and Path(path).is_dir() and Path(path) not in seen:
        path = Path(path)
        seen.add(path)
        if not is_run_checkpoint(path):
            return path
        path = (read_meta(path)["identity"]["model"] or {}).get("init_from")
    return None


def _hf_config(model: Mapping[str, Any], source: Path | None) -> dict[str, Any]:
    """config.json for the run's model, with the token ids of the directory it started from (a multimodal
    wrapper's may sit on its text_config)."""
    config = hf_config_from_model(model)
    if source is not None and (source / "config.json").is_file():
        original = read_hf_config(source)
        text = original.get("text_config") or {}
        for key in _TOKEN_FIELDS:
            value = original.get(key, text.get(key))
            if value is not None:
                config[key] = value
    return config


def _stored_fused(source: Path | None) -> bool:
    """Whether the HF directory a run started from stored its experts fused (export then writes them so too)."""
    if source is None or not (source / "config.json").is_file():
        return False
    from megatron_iso.checkpoint.lazy import LazyHFSource

    try:
        with LazyHFSource(source, read_hf_config(source)) as src:
            return src.fused_experts
    except (OSError, ValueError, KeyError):
        return False


def verify_run_checkpoint(ckpt_dir: str | Path, use: Callable[[Path], str]) -> None:
    """Every file of a run checkpoint is the one saved (``checkpoint.integrity``); an :class:`IntegrityError` naming
    the file otherwise, with the previous complete checkpoint and ``use(it)``, how to use that one instead. A
    collective over the world when one is up."""
    ckpt_dir = Path(ckpt_dir)
    try:
        verify_checksums(ckpt_dir)
    except IntegrityError as exc:
        raise IntegrityError(f"checkpoint refused: {exc}{offer_previous(ckpt_dir, use)}") from None


def export_run_checkpoint(
    ckpt_dir: str | Path, out_dir: str | Path, max_shard_bytes: int | None = None, *, check: bool = True
) -> list[str]:
    """Write a run checkpoint's weights as an HF directory (config.json, safetensors, and the tokenizer and
    generation files of the directory the run started from, when there is one); return the weight file names.
    ``check``: verify its files' recorded SHA-256 first (False: the caller has, or wrote them itself)."""
    ckpt_dir = Path(ckpt_dir)
    if check:
        verify_run_checkpoint(ckpt_dir, lambda p: f"export it instead: iso-convert export --ckpt {p} --out DIR")
    meta = read_meta(ckpt_dir)
    model = meta["identity"]["model"]
    if meta.get("format") == DIST_FORMAT:  # any layout (TP, EP, PP) reads as TP 1
        tc = run_model_config(model, 1, 1)
        hf = hf_from_megatron_shards([_dist_tp1_shard(ckpt_dir, tc)], tc, 1)
    else:
        layout = run_layout(ckpt_dir, meta)
        tc = run_model_config(model, layout.tp, layout.ep)
        # hf_from_megatron_shards reads EP rank 0's TP ranks and each EP rank's TP rank 0: only those slots filled.
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.tp * layout.ep)]
        for t in range(layout.tp):
            shards[t] = read_rank_file(ckpt_dir, layout.tp_owner[t], experts=False if layout.ep > 1 else None)
        for e in range(layout.ep if layout.ep > 1 else 0):
            shards[e * layout.tp] |= read_rank_file(ckpt_dir, layout.ep_owner[e], experts=True)
        hf = hf_from_megatron_shards(shards, tc, layout.ep)
    source = _source_dir(model)
    if tc.num_moe_experts and _stored_fused(source):
        hf = fuse_experts(hf, tc)
    files = write_hf_dir(out_dir, hf, _hf_config(model, source), max_shard_bytes)
    if source is not None:
        copy_assets(source, out_dir)
    return files


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_hf(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    model_group: Mapping[str, Any],
    tc: IsoTransformerConfig,
    *,
    rank: int,
) -> Path:
    """``rl.save_hf_every``: the policy's weights as ``<run>/hf/step_<N>/`` (an HF directory transformers loads).
    Every rank that holds a TP / EP position first (no data-parallel copy) writes its parameters, then rank 0 assembles the directory with
    :func:`export_run_checkpoint` in a temporary sibling and renames it into place. All ranks call this."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, ep = tc.tensor_model_parallel_size, tc.expert_model_parallel_size
    final = run_dir / "hf" / f"step_{step:06d}"
    staging = final.with_name(f".{final.name}.ranks")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    if rank in rank_layout(world, tp, ep).writers():
        params = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
        from safetensors.torch import save_file

        save_file(params, str(staging / RANK_FILE.format(rank)))
    _barrier()
    if rank == 0:
        write_json(
            staging / META, {"step": step, "tp": tp, "world_size": world, "identity": {"model": dict(model_group)}}
        )
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            export_run_checkpoint(staging, tmp, check=False)  # just written here, with no record
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    return final


__all__ = [
    "DIST_FORMAT",
    "checkpoint_tensors",
    "export_run_checkpoint",
    "is_dist_checkpoint",
    "is_run_checkpoint",
    "load_run_weights",
    "read_meta",
    "run_layout",
    "save_hf",
    "verify_run_checkpoint",
]
