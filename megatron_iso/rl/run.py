"""The RL run: ``rl.steps`` steps of the :class:`~megatron_iso.rl.trainer.Trainer` in a run directory.

What a run adds to the trainer's steps: its directory (given, or a new ``runs/<UTC time>-<id>``), the lock and the
start decided under it (new or resumed: ``rl.run_dir``), the checkpoints it writes and resumes from
(``rl.checkpoint``, with the identity a resume must match), HF exports (``rl.save_hf_every``), validation
(``rl.validation``), the metrics log and dashboard (``rl.metrics``) and the progress bar. Everything is decided
from the typed settings (:func:`megatron_iso.settings.resolve`); the resolved config is only recorded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm.auto import tqdm

from megatron_iso.checkpoint.init_from import apply_init_from
from megatron_iso.checkpoint.run_ckpt import save_hf
from megatron_iso.rl.checkpoint import (
    CheckpointError,
    finished_step,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron_iso.rl.metrics import MetricsLog
from megatron_iso.rl.ppo import schedule_line
from megatron_iso.rl.run_dir import default_run_dir, identity_diff, locked_start, plan_start
from megatron_iso.rl.trainer import Trainer
from megatron_iso.rl.validation import due, validate
from megatron_iso.settings import (
    RLSettings,
    Settings,
    check_trainable,
    config_world,
    config_yaml,
    resolve,
    with_out_dir,
)


# Keys a checkpoint must agree on with the run that resumes it. Not the layout: checkpoints reshard (rl.checkpoint),
# and the numerical policy digest already refuses a layout that changes bits (a pinned TP, another device class).
def _checkpoint_identity(trainer: Trainer) -> dict[str, Any]:
    return {"numerical_policy": trainer.policy_digest, **trainer.tasks.identity()}  # the data, in its order


def _checkpoint_layout(trainer: Trainer) -> dict[str, Any]:
    """Where a checkpoint was written (recorded in meta.json, not checked on resume)."""
    tc = trainer.tc
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "tp": tc.tensor_model_parallel_size,
            "pp": tc.pipeline_model_parallel_size, "ep": tc.expert_model_parallel_size, "dp": trainer.dp_size,
            "use_distributed_optimizer": trainer.rl.use_distributed_optimizer}  # fmt: skip


def run_identity(settings: Settings) -> dict[str, Any]:
    """What a run trains: its model and task (as configured). Resuming with any other is refused, the differing
    keys named."""
    return {key: settings.config[key] for key in ("model", "task")}


def _check_resumable(checkpoint: Path, settings: Settings) -> None:
    saved = json.loads((checkpoint / "meta.json").read_text()).get("identity")
    if saved is None:
        raise CheckpointError(f"checkpoint {checkpoint} records no run identity (model, task); it cannot be resumed")
    diff = identity_diff(saved, run_identity(settings))
    if diff:
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained with another model or task ({'; '.join(diff[:4])}"
            f"{'; ...' if len(diff) > 4 else ''}); resume with the same settings or choose a new out_dir"
        )


# Metrics whose values depend on wall-clock or memory, not on the computation: excluded when
# comparing a resumed run with an uninterrupted one.
TIMING_PREFIXES = ("timing/", "throughput/", "memory/")


def _plan_start(run_dir: Path, settings: Settings) -> Path | None:
    """The checkpoint to resume from in ``run_dir`` (None: a new run), by the rules of ``rl.run_dir``."""
    resume_from = plan_start(run_dir, settings.resume, latest_checkpoint(run_dir) if run_dir.exists() else None)
    if resume_from is not None:
        _check_resumable(resume_from, settings)
    return resume_from


def _new_run_dir(settings: Settings, rank: int) -> Settings:
    """A run without ``out_dir``: a new ``runs/<UTC time>-<id>`` (the same on every rank), printed, and put into
    a copy of ``settings`` (its recorded config too: what config.yaml and the logger record)."""
    run_dir = default_run_dir()
    if rank == 0:
        print(f"out_dir={run_dir} (a new run directory; out_dir=PATH chooses one)", file=sys.stderr)
    return with_out_dir(settings, run_dir)


def train(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Run ``rl.steps`` RL steps of the composed config ``cfg`` (``load_config``) in its
    ``out_dir``: a new run (``resume=false``), the continuation of its latest checkpoint (``resume=true``), or
    either (``resume=auto``); the rules: ``rl.run_dir``. Without an ``out_dir`` (null) the run gets a new
    directory, named once the world is up and before anything is written."""
    # Megatron logs every DDP bucket's parameter names at INFO; keep the console to the progress bar.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    cfg = apply_init_from(cfg)  # model.init_from: the checkpoint's model group (and tokenizer)
    settings = resolve(cfg)
    check_trainable(settings)
    rl: RLSettings = settings.require("rl")
    # An out_dir given is checked before any world opens (a refusal writes nothing); the start is decided under the lock.
    if settings.out_dir is not None:
        resume_from = _plan_start(settings.out_dir, settings)
        done = None if resume_from is None else finished_step(resume_from, rl.steps)
        if done is not None:  # nothing left to run: no world, nothing written
            return {"run_dir": str(settings.out_dir), "steps_run": 0, "history": [], "dashboard": None,
                    "validation": {}, "finished_at": done}  # fmt: skip
    with contextlib.ExitStack() as stack:
        rank = stack.enter_context(config_world(settings))
        if settings.out_dir is None:
            settings = _new_run_dir(settings, rank)  # a directory no run has: nothing to resume
        run_dir: Path = settings.out_dir
        trainer = Trainer(settings, rank)
        # Locked once the run is built (a run that fails to build writes nothing), before anything is written;
        # the start (new or resumed) is decided under the lock, as another run may have written here meanwhile.
        resume_from = stack.enter_context(locked_start(run_dir, lambda: _plan_start(run_dir, settings), rank))
        start = 0
        if resume_from is not None:
            meta = load_checkpoint(
                resume_from, trainer.model, trainer.optimizer, _checkpoint_identity(trainer), rank=rank
            )
            start = int(meta["step"]) + 1
            trainer.schedule.step(start)
            trainer.publish_weights()
        identities = trainer.contract.identities.to_dict()
        if rank == 0:
            print(
                f"run {run_dir}: profile {settings.profile.name.value} on {settings.device_class}, contract "
                + ", ".join(f"{k} {v[:12]}" for k, v in sorted(identities.items())),
                file=sys.stderr,
            )
            if (line := schedule_line(trainer)) is not None:
                print(line, file=sys.stderr)
            # The first config stays config.yaml; a resumed run's own goes beside it.
            name = "config.yaml" if resume_from is None else f"config.resumed_step{start:06d}.yaml"
            (run_dir / name).write_text(config_yaml(settings))
        log = MetricsLog(
            run_dir,
            settings.config.get("logger") or {},
            {**settings.config, "contract": identities},
            resume_step=None if resume_from is None else start,
            enabled=rank == 0,
            summary=trainer.tasks.summary(),
        )
        steps = rl.steps
        every = rl.checkpoint_every
        meta = {**_checkpoint_identity(trainer), **_checkpoint_layout(trainer), "identity": run_identity(settings),
                "contract": identities}  # fmt: skip
        history = []
        bar = _progress(range(start, steps), rank == 0)
        try:
            for step in bar:
                metrics = {**(validate(trainer, step) if due(rl, step) else {}), **trainer.step(step)}
                log.log(step, metrics, trainer.step_tokens)
                history.append(metrics)
                if rank == 0 and hasattr(bar, "set_postfix"):
                    bar.set_postfix(
                        reward=f"{metrics['reward/mean']:.3f}",
                        dlogp_max=f"{metrics.get('mismatch/abs_diff_max', 0):.2e}",
                    )
                if (step + 1) % every == 0 or step + 1 == steps:
                    save_checkpoint(run_dir, step, trainer.model, trainer.optimizer, meta, rank=rank,
                                    keep=rl.keep_checkpoints)  # fmt: skip
                if rl.save_hf_every and ((step + 1) % rl.save_hf_every == 0 or step + 1 == steps):
                    save_hf(run_dir, step, trainer.model, meta["identity"]["model"], trainer.tc, rank=rank)
            final = validate(trainer, steps) if due(rl, steps, last=True) else {}  # the trained policy's
            if final:
                log.log(steps, final)
            dashboard = log.write_dashboard()  # rank 0's, also to W&B; None elsewhere
        finally:
            log.close()
        return {"run_dir": str(run_dir), "steps_run": len(history), "history": history, "dashboard": str(dashboard),
                "validation": final, "last_step": start + len(history) - 1 if history else None}  # fmt: skip


def _progress(steps: range, show: bool) -> Any:
    return tqdm(steps, desc="rl steps", initial=steps.start, total=steps.stop, dynamic_ncols=True) if show else steps
