"""A run directory's rules: one run at a time, explicit resume, nothing a run wrote is ever lost.

- ``resume=false`` starts a new run and refuses a directory that already holds one; ``resume=true``
  continues the latest checkpoint and refuses when there is none (a mistyped ``out_dir`` must not
  start from scratch); ``resume=auto`` continues when there is a checkpoint and starts otherwise.
- An exclusive lock (``<run>/.lock``, released by the OS when the process ends) keeps two processes
  from writing one directory; the start (new or resumed) is decided while it is held (:func:`locked_start`).
- A resumed run recomputes the steps after its checkpoint; their old metrics lines move to
  ``metrics.rewound.jsonl`` instead of being deleted, and a torn last line (a crash mid-write) is
  kept there too.
- What the run trains (model, task, tokenizer) is its identity: resuming with another one is refused
  with the differing keys named.
- Without an ``out_dir`` a run gets a directory of its own, ``runs/<UTC start time>-<random id>``
  (:func:`default_run_dir`), the same on every rank of a launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from megatron_iso.errors import UserError

METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"
LOCK_FILE = ".lock"
# Where runs without an out_dir go (relative to the working directory, as a relative out_dir is).
RUNS_ROOT = Path("runs")


class RunDirError(UserError, RuntimeError):
    """The run directory cannot be used as asked; the message names the directory and the way out."""


def new_run_name(now: datetime | None = None, token: str | None = None) -> str:
    """A default run directory's name: the UTC start time to the second and 6 random hex digits
    (``20261203-221500-3fa2c1``): names sort by start time, and two runs started in the same second differ."""
    now = now if now is not None else datetime.now(timezone.utc)
    token = token if token is not None else secrets.token_hex(3)
    return f"{now.astimezone(timezone.utc):%Y%m%d-%H%M%S}-{token}"


def default_run_dir(root: Path = RUNS_ROOT) -> Path:
    """``root/<new_run_name()>``, a path nothing exists at yet, the same on every rank: the ranks of a launch
    start at different times and draw different ids, so rank 0 names it and broadcasts the name (one
    collective; call it on every rank of an initialised world, or without one)."""
    import torch.distributed as dist

    name = new_run_name()
    while (root / name).exists():  # another run started in the same second and drew the same id
        name = new_run_name()
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return root / name


def plan_start(run_dir: Path, mode: str, latest: Path | None) -> Path | None:
    """The checkpoint to resume from, or None for a new run; refuses a start that would mix or lose data.

    ``mode``: ``settings.resume`` (false | true | auto); ``latest``: the directory's latest complete
    checkpoint (``rl.checkpoint.latest_checkpoint``).
    """
    metrics = run_dir / METRICS_FILE
    if mode == "false":
        if latest is not None or metrics.exists():
            raise RunDirError(
                f"out_dir={run_dir} already holds a run; resume=true continues it, resume=auto starts or continues, "
                "or choose another out_dir"
            )
        return None
    if latest is None and metrics.exists():
        raise RunDirError(
            f"out_dir={run_dir} holds {METRICS_FILE} but no complete checkpoint, so there is nothing to resume and "
            "starting over would mix two runs' metrics; choose another out_dir"
        )
    if mode == "true" and latest is None:
        what = "does not exist" if not run_dir.exists() else "holds no checkpoint"
        raise RunDirError(
            f"resume=true but out_dir={run_dir} {what}; check the path, or use resume=auto to start or continue"
        )
    return latest


class RunLock:
    """An exclusive lock on a run directory for the life of the process that holds it."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self._lock = FileLock(str(self.path))

    def __enter__(self) -> RunLock:
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise RunDirError(
                f"out_dir={self.path.parent} is in use by another run (lock {self.path}); "
                "wait for it to end or choose another out_dir"
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@contextlib.contextmanager
def locked_start(run_dir: Path, plan: Callable[[], Path | None], rank: int = 0) -> Iterator[Path | None]:
    """Hold the run lock (rank 0) for the body and yield the start decided under it: ``plan()`` (the
    checkpoint to resume from, or None for a new run, by :func:`plan_start`'s rules) runs once the lock is
    held, so a second run that passed an early check while the directory was free or still being set up
    cannot start over a run that has since written there. Rank 0 decides; the other ranks of the world get
    its decision, or its refusal (a :class:`RunDirError` on every rank, none left waiting)."""
    import torch.distributed as dist

    multi = dist.is_initialized() and dist.get_world_size() > 1
    with contextlib.ExitStack() as stack:
        box: list[Any] = [None]
        if rank == 0:
            try:
                stack.enter_context(RunLock(run_dir))
                box[0] = ("start", plan())
            except Exception as exc:
                if not multi:
                    raise
                box[0] = ("refused" if isinstance(exc, UserError) else "failed", " ".join(str(exc).split()))
                dist.broadcast_object_list(box, src=0)
                raise
        if multi:
            dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "refused":
            raise RunDirError(f"rank 0 refused to start: {value}")
        if kind == "failed":
            raise RuntimeError(f"rank 0 failed to start the run: {value}")
        yield value


def rewind_metrics(run_dir: Path, resume_step: int, name: str = METRICS_FILE) -> int:
    """Cut ``metrics.jsonl`` (or another per-step log of the run, ``name``: every line a JSON object with a
    ``step``) back to the steps before ``resume_step``; returns the lines kept.

    The cut lines (the steps the resumed run recomputes) and a torn last line are appended to
    ``metrics.rewound.jsonl`` (``<name's stem>.rewound.jsonl``). A damaged line before the last one is an error
    naming it: that is not a crash mid-write, and guessing would lose data.
    """
    path = run_dir / name
    rewound = REWOUND_FILE if name == METRICS_FILE else f"{Path(name).stem}.rewound.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept: list[str] = []
    moved: list[str] = []
    for i, line in enumerate(lines):
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if i + 1 < len(lines):
                raise RunDirError(
                    f"{path} line {i + 1} is not a metrics record ({line[:60]!r}); repair or move the file to resume"
                ) from None
            moved.append(line)
            continue
        (kept if step < resume_step else moved).append(line)
    if moved:
        with (run_dir / rewound).open("a") as f:
            f.write("".join(line + "\n" for line in moved))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(kept)


def identity_diff(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings (missing on one side counts)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(identity_diff(a, b, name + "."))
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out
