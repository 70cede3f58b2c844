"""What a run asks of this machine, checked before any rank starts: the launch's world against ``parallel.dp``,
memory for the model and the rollout's KV cache, and a run directory it can write.

The memory check is a lower bound, not a forecast: it refuses what cannot fit whatever the activations take (the
weights, their gradients and Adam's state per rank; the KV cache; one micro-batch's LM-head logits), and names the
setting that asks for the most. A run it lets through may still run out of memory on activations.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_iso.settings.fields import SettingsError
from megatron_iso.settings.shapes import human_bytes, parameter_counts

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
# Adam's state per parameter: m and v in fp32, plus fp32 main weights when the model's own are bf16.
ADAM_BYTES = {"bf16": 12, "fp32": 8}


def launch_world() -> int:
    """Processes in this launch: the enclosing world's, torchrun's ``WORLD_SIZE``, else 1 (a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def check_launch(tp: int, pp: int, ep: int, world: int) -> None:
    """The launch can hold the layout: a single process only the layout of one rank (the launcher's message, with
    the torchrun command that gives the layout), a torchrun world a multiple of tp x pp."""
    # The launcher's own message (world.launched_world raises it too, later): one wording of it.
    from megatron_iso.parallel.world import LaunchError, _needs_torchrun

    if world == 1 and tp * pp * ep != 1 and "WORLD_SIZE" not in os.environ:
        raise LaunchError(_needs_torchrun(tp, pp, ep))
    if world % (tp * pp):
        raise SettingsError(
            f"parallel.tp*parallel.pp={tp * pp} does not divide the launch's world size {world}; "
            f"start a multiple of {tp * pp} processes (torchrun --nproc-per-node)"
        )


def data_parallel(tp: int, pp: int, dp: int | None, world: int) -> int:
    """The data-parallel degree of a launch of ``world`` processes: world / (tp * pp). ``parallel.dp`` null takes
    it; a value must equal it (Megatron derives it from the world: a different one would be silently ignored)."""
    derived = max(1, world // (tp * pp))
    if dp is not None and dp != derived and world % (tp * pp) == 0:
        launch = "a single process" if world == 1 else f"{world} processes"
        raise SettingsError(
            f"parallel.dp={dp} does not match the launch: {launch} / (parallel.tp={tp} x parallel.pp={pp}) gives "
            f"data parallel {derived}; allowed values: null (derived from the world size) or {derived}; for dp={dp} "
            f"launch {dp * tp * pp} processes (torchrun --nproc-per-node {dp * tp * pp})"
        )
    return derived


def device_memory(device_class: str) -> tuple[int, str]:
    """(bytes, what) a rank of this launch can use at most: the GPU's memory, or the host's shared by its local
    processes."""
    if device_class == "cuda":
        import torch

        local = int(os.environ.get("LOCAL_RANK", "0"))
        props = torch.cuda.get_device_properties(local % max(1, torch.cuda.device_count()))
        return int(props.total_memory), f"the GPU's {human_bytes(props.total_memory)} ({props.name})"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = total // max(1, local)
    per = f" shared by {local} processes" if local > 1 else ""
    return share, f"the host's {human_bytes(total)} of memory{per}"


def memory_needs(settings: Any, prompts_per_step: int | None, dp: int) -> dict[str, tuple[int, str]]:
    """Bytes per rank that the run needs at least, by part: {part: (bytes, the settings that size it)}."""
    model, p, rl = settings.model, settings.parallel, settings.rl
    raw: Mapping[str, Any] = model.raw
    counts = parameter_counts(raw)
    dtype, adam = DTYPE_BYTES[model.params_dtype], ADAM_BYTES[model.params_dtype]
    shard_opt = dp if rl is not None and rl.use_distributed_optimizer else 1
    per_param = 2 * dtype + adam / shard_opt  # weights, gradients, optimizer state

    def named(*keys: str) -> str:
        return " x ".join(f"model.{k}={raw.get(k)}" for k in keys)

    needs = {
        "embedding": (int(counts["embedding"] / (p.tp * p.pp) * per_param), named("vocab_size", "hidden_size")),
        "layers": (int(counts["layers"] / (p.tp * p.pp) * per_param), named("num_layers", "hidden_size")),
    }
    if counts["experts"]:
        needs["experts"] = (
            int(counts["experts"] / (p.ep * p.pp) * per_param),
            named("num_experts", "moe_ffn_hidden_size"),
        )
    if settings.rollout is not None:
        needs["kv_cache"] = (settings.rollout.kv_cache_bytes, f"rollout.kv_cache_mb={settings.rollout.kv_cache_mb}")
    if rl is not None and prompts_per_step is not None:
        # The trainer's LM head over one micro-batch of this rank's samples: a logit per response token and
        # vocabulary entry of this TP rank (at least in the params dtype).
        rows = max(1, prompts_per_step * rl.group_size // dp)
        if rl.train_micro_batch_seqs:
            rows = min(rows, rl.train_micro_batch_seqs)
        logits = rows * rl.max_response_length * (model.vocab_size // p.tp) * dtype
        needs["logits"] = (logits, f"task.prompts_per_step={prompts_per_step} x rl.group_size={rl.group_size}")
    return needs


def check_memory(settings: Any, prompts_per_step: int | None, dp: int) -> None:
    """Refuse a run whose lower bound of memory (:func:`memory_needs`) exceeds what one rank has, naming the
    settings that ask for the most."""
    needs = memory_needs(settings, prompts_per_step, dp)
    have, what = device_memory(settings.device_class)
    total = sum(b for b, _ in needs.values())
    if total <= have:
        return
    part, (_, fields) = max(needs.items(), key=lambda kv: kv[1][0])
    shown = ", ".join(f"{k} {human_bytes(b)}" for k, (b, _) in needs.items() if b)
    lower = " or ".join(f.split("=", 1)[0] for f in fields.split(" x "))
    shard = (
        " or shard the model (parallel.tp / parallel.pp / parallel.ep)"
        if part in ("embedding", "layers", "experts")
        else ""
    )
    raise SettingsError(
        f"{fields} needs more memory than a rank has: at least {human_bytes(total)} per rank ({shown}; parameters "
        f"with their gradients and Adam's state) against {what}; lower {lower}{shard}"
    )


def check_writable_dir(value: Path | None, field_name: str = "out_dir", shown: str | None = None) -> None:
    """Refuse a run directory this process cannot create or write, before any rank starts: one that names a file,
    or whose nearest existing ancestor is not a writable directory (a read-only mount, /proc). Probed by making
    and removing a directory there, as permission bits do not tell (root, read-only file systems). None: the
    default ``runs/`` under the working directory. ``shown``: how the error names the setting (default: the field
    and ``value``)."""
    target = Path("runs") if value is None else value.expanduser()
    if shown is None:
        shown = f"{field_name}={str(value)!r}" if value is not None else f"{field_name}=null (a new runs/<time>-<id>)"
    if target.exists() and not target.is_dir():
        raise SettingsError(f"{shown} names a file, not a directory; allowed values: a directory path")
    probe_in = target.absolute()
    while not probe_in.exists():
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        raise SettingsError(f"{shown}: {probe_in} is a file, not a directory; allowed values: a directory path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".iso-write-probe-", dir=probe_in))
    except OSError as exc:
        raise SettingsError(
            f"{shown} cannot be written: {probe_in} refuses new entries ({exc.strerror or exc}); allowed values: a "
            "directory path under a writable directory"
        ) from None
