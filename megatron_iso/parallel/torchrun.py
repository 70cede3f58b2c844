"""Run a function on N ranks started by ``torchrun`` and collect each rank's result: the GPU twin of
:func:`megatron_iso.parallel.launch.run_on_ranks` (same call shape, same per-rank setup).

:func:`run_under_torchrun` writes the job (the module-level ``fn``, its ``args``, the layout, the
seed) to a private directory and starts ``torchrun --standalone --nproc-per-node N -m
megatron_iso.parallel.torchrun DIR`` as a subprocess. Each rank (this module's ``__main__``) opens
its world through :func:`megatron_iso.parallel.world.launched_world`: on ``cuda:<LOCAL_RANK>`` with
NCCL when CUDA is available, gloo CPU ranks otherwise, then calls ``fn(*args)`` and writes its
result (or its traceback) to ``DIR/rank<R>.pt``. The caller reads the files back in rank order, the
tensors mapped to the CPU. A rank's failure is raised here as
:class:`~megatron_iso.parallel.launch.RankFailure` with its traceback and the tail of torchrun's
output.

On a CPU machine the ranks are gloo ranks seeded and threaded exactly as ``run_on_ranks`` seeds and
threads them, so both launchers give the same bits for the same function (tested); that is what
lets CI exercise the NCCL tests' code path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_iso.parallel.launch import RankFailure, check_layout, cpu_threads_per_rank

_JOB = "job.pt"
_LOG = "torchrun.log"
_TAIL_CHARS = 6000


def _rank_file(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.pt"


DEVICES = ("auto", "cpu")


def _child_env(devices: str) -> dict[str, str]:
    """The caller's environment, with its import path handed on: the ranks unpickle ``fn`` by its
    module name, which may live where only the caller's ``sys.path`` reaches (pytest's rootdir).
    ``devices="cpu"`` hides the GPUs from the ranks (gloo CPU ranks on a GPU machine)."""
    env = dict(os.environ)
    here = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join([*here, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    if devices == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def torchrun_command(world_size: int, job_dir: str | Path) -> list[str]:
    """The command one launch runs (``torch.distributed.run`` is torchrun's module)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "-m",
        __name__,
        str(job_dir),
    ]


def _tail(path: Path) -> str:
    if not path.exists():
        return ""
    text = path.read_text(errors="replace")
    return text[-_TAIL_CHARS:]


def run_under_torchrun(
    fn: Callable[..., Any],
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    args: Sequence[Any] = (),
    seed: int = 1234,
    timeout: float = 600.0,
    devices: str = "auto",
    cp: int = 1,
) -> list[Any]:
    """Call module-level ``fn(*args)`` on ``world_size`` torchrun ranks; return results in rank order.

    The layout arguments mean what they mean for ``run_on_ranks``. ``devices``: "auto" puts each
    rank on its GPU (NCCL) when CUDA is available, and then ``world_size`` must not exceed the GPU
    count (one process per GPU); "cpu" runs gloo CPU ranks whatever the machine has."""
    check_layout("run_under_torchrun", world_size, tp, pp, ep, etp, cp)
    if devices not in DEVICES:
        raise ValueError(f"run_under_torchrun: devices={devices!r} is not allowed; allowed values: {list(DEVICES)}")
    if devices == "auto" and torch.cuda.is_available() and world_size > torch.cuda.device_count():
        raise ValueError(
            f"run_under_torchrun: world_size={world_size} exceeds the {torch.cuda.device_count()} CUDA devices "
            "(one rank per GPU)"
        )
    with tempfile.TemporaryDirectory(prefix="iso-torchrun-") as tmp:
        job_dir = Path(tmp)
        job = {
            "fn": fn,
            "args": tuple(args),
            "layout": {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "cp": cp},
            "seed": seed,
            "world_size": world_size,
        }
        torch.save(job, job_dir / _JOB)
        log = job_dir / _LOG
        with log.open("w") as out:
            # Own session: on a timeout the whole torchrun tree (agent and ranks) is killed, nothing else.
            proc = subprocess.Popen(
                torchrun_command(world_size, job_dir),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_child_env(devices),
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RankFailure(
                    f"torchrun did not finish within {timeout:.0f} s; its output ends:\n{_tail(log)}"
                ) from None
        results: dict[int, Any] = {}
        failures: list[str] = []
        for r in range(world_size):
            path = _rank_file(job_dir, r)
            if not path.exists():
                continue
            ok, payload = torch.load(path, map_location="cpu", weights_only=False)
            if ok:
                results[r] = payload
            else:
                failures.append(f"--- rank {r} ---\n{payload}")
        if failures or len(results) < world_size or code != 0:
            missing = sorted(set(range(world_size)) - set(results))
            raise RankFailure(
                f"torchrun exited with code {code}; ranks without a result: {missing}\n"
                + "\n".join(failures)
                + f"\n--- torchrun output (tail) ---\n{_tail(log)}"
            )
        return [results[r] for r in range(world_size)]


def _rank_main(job_dir: Path) -> int:
    """One torchrun rank: open the layout's world, run the job, write this rank's result file."""
    rank = int(os.environ["RANK"])
    ok, payload = False, ""
    try:
        # Patches first: unpickling ``fn`` may import Megatron modules (e.g. a test module's).
        from megatron_iso.platform import apply_cpu_patches, silence_expected_cpu_warnings

        silence_expected_cpu_warnings()
        apply_cpu_patches()
        from megatron_iso.parallel.world import launched_world

        job = torch.load(job_dir / _JOB, weights_only=False)
        world = int(os.environ["WORLD_SIZE"])
        if world != job["world_size"]:
            raise RuntimeError(f"torchrun started {world} ranks but the job asks for world_size={job['world_size']}")
        if not torch.cuda.is_available():
            torch.set_num_threads(cpu_threads_per_rank(world))
        lay = job["layout"]
        with launched_world(lay["tp"], lay["pp"], lay["ep"], seed=job["seed"], etp=lay["etp"], cp=lay["cp"]):
            payload = job["fn"](*job["args"])
        ok = True
    except BaseException:  # every failure, assertion errors included, goes back to the caller
        payload = traceback.format_exc()
    tmp = _rank_file(job_dir, rank).with_suffix(".tmp")
    torch.save((ok, payload), tmp)
    tmp.replace(_rank_file(job_dir, rank))  # the caller never reads a half-written file
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: torchrun --nproc-per-node N -m {__spec__.name if __spec__ else __name__} JOB_DIR")
    sys.exit(_rank_main(Path(sys.argv[1])))
