"""The worlds megatron_iso opens: torch.distributed plus Megatron's parallel_state for a layout.

``megatron_world`` (one world, any init), ``single_process_world`` (TP=PP=EP=1 in the calling process:
conversion checks, notebooks, CLIs), ``launched_world`` (a torchrun launch: gloo on CPU, NCCL on
``cuda:<LOCAL_RANK>``; ``settings.config_world`` opens it for a config). Multi-rank tests start their ranks with ``parallel.launch.run_on_ranks``
(forked gloo ranks) or ``parallel.torchrun.run_under_torchrun`` (torchrun; NCCL on GPUs)."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_iso.errors import UserError


class LaunchError(UserError, ValueError):
    """A layout the launch cannot run (e.g. ``parallel.tp=2`` in one process); the message names the setting
    and how to launch it."""


def _torchrun_target() -> str:
    """What torchrun runs to start this program again: ``-m MODULE`` for a module run with ``-m`` or one of the
    package's console scripts (iso-train, iso-bench, ...), a script's path (tools/bench_rl_step.py), else a
    placeholder. A launch error's hint names it, whichever tool opened the world."""
    import sys
    from importlib.metadata import entry_points

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return f"-m {spec.name}"
    argv0 = sys.argv[0] if sys.argv else ""
    for script in entry_points(group="console_scripts", name=os.path.basename(argv0)):
        if script.module.split(".")[0] == "megatron_iso":
            return f"-m {script.module}"
    return argv0 if argv0.endswith(".py") else "<your program>"


def _needs_torchrun(tp: int, pp: int, ep: int, cp: int = 1) -> str:
    """One line: the settings that need several processes, and the torchrun launch of this program that gives
    them."""
    nproc = math.lcm(tp * pp * cp, ep * pp)
    named = [f"parallel.{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)) if v != 1]
    return (
        f"{', '.join(named)} {'needs' if len(named) == 1 else 'need'} {nproc} processes, and this is a single "
        f"process (not started by torchrun); launch it with torchrun, e.g. `torchrun --nproc-per-node {nproc} "
        f"{_torchrun_target()} {' '.join(named)} ...`, or set {' '.join(k.split('=')[0] + '=1' for k in named)}"
    )


# The world's collective timeout (``init_process_group(timeout=...)``, i.e. ``dist_timeout_s``) while a world
# opened by :func:`megatron_world` is up; None: torch's default.
_TIMEOUT: datetime.timedelta | None = None


def collective_timeout() -> datetime.timedelta | None:
    """How long a collective of this world waits for the other ranks (None: torch's default)."""
    return _TIMEOUT


def initialize_layout(tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, cp: int = 1) -> None:
    """Megatron's parallel_state for a layout: the one call every launcher makes.

    ``cp``: context parallelism (Megatron's CP groups: ranks that split one sequence's rows, weights replicated;
    ``parallel.context``).
    Expert tensor parallelism defaults to 1 (megatron_iso's invariant experts are whole per EP
    rank; Megatron would otherwise default it to the TP size). Megatron's groups (TP, EP, DP, ...) get the
    world's collective timeout: Megatron would give them its own 30 minutes, so ``dist_timeout_s`` would stop
    only the collectives of the default group (an expert all-to-all would wait half an hour).
    """
    from megatron.core import parallel_state

    timeout = {} if _TIMEOUT is None else {"distributed_timeout_minutes": _TIMEOUT / datetime.timedelta(minutes=1)}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        **timeout,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def seed_ranks(seed: int) -> None:
    """torch's RNG and Megatron's model-parallel RNG tracker from ``seed``, as a new world seeds
    them; a run that starts over inside a world it keeps (tools/bench_rl_step.py) calls it again."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


@contextlib.contextmanager
def megatron_world(
    init: dict[str, object], tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, seed: int = 1234, cp: int = 1
) -> Iterator[None]:
    """torch.distributed (``init_process_group(**init)``) plus Megatron's parallel_state for the
    layout, seeded, for the body; both torn down after. Every world megatron_iso starts goes here."""
    from megatron_iso.platform import apply_cpu_patches, silence_expected_cpu_warnings

    silence_expected_cpu_warnings()
    apply_cpu_patches()
    from megatron.core import parallel_state

    global _TIMEOUT
    dist.init_process_group(**init)
    _TIMEOUT = init.get("timeout")  # type: ignore[assignment]
    try:
        initialize_layout(tp, pp, ep, etp, cp)
        seed_ranks(seed)
        yield
    finally:
        _TIMEOUT = None
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def single_process_world(seed: int = 1234) -> Iterator[None]:
    """Initialise torch.distributed (world size 1; gloo on CPU, NCCL with CUDA) and Megatron's parallel_state for the body,
    then tear both down. If the caller already runs inside a distributed world, that world is used
    as it is and left alone (it must then already have Megatron's parallel_state set up)."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("torch.distributed is initialised but Megatron's parallel_state is not")
        yield
        return
    # A private rendezvous (tcp on a free port) so the caller's MASTER_ADDR/PORT are not touched.
    init = {"backend": default_backend(), "init_method": f"tcp://127.0.0.1:{free_port()}", "rank": 0, "world_size": 1}
    with megatron_world(init, seed=seed):
        yield


@contextlib.contextmanager
def launched_world(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    seed: int = 1234,
    etp: int = 1,
    timeout_s: float | None = None,
    cp: int = 1,
) -> Iterator[int]:
    """The world of a launch: torchrun's (``RANK``/``WORLD_SIZE`` in the environment; gloo on CPU,
    NCCL on CUDA with this process on ``cuda:<LOCAL_RANK>``) or, without torchrun, one local process.
    Megatron's parallel_state is initialised with the given layout; yields this process's global
    rank. Inside an already initialised world (e.g. a ``run_on_ranks`` rank) that world is used as it
    is, if its layout is the one asked for. ``timeout_s``: how long a collective waits for the other ranks
    (torch's default when None)."""
    if dist.is_initialized():
        yield _enclosing_world(tp, pp, ep, cp)
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if tp * pp * ep * cp != 1:
            raise LaunchError(_needs_torchrun(tp, pp, ep, cp))
        with single_process_world(seed):
            yield 0
        return
    world = int(os.environ["WORLD_SIZE"])
    if world % (tp * pp * cp):
        raise LaunchError(
            f"parallel.tp*parallel.pp*parallel.cp={tp * pp * cp} does not divide the launch's world size {world}; "
            f"start a multiple of {tp * pp * cp} processes (torchrun --nproc-per-node)"
        )
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local} but this machine has {torch.cuda.device_count()} CUDA devices: "
                "start at most one process per GPU (torchrun --nproc-per-node <= GPU count)"
            )
        # Before the process group: NCCL binds this rank's communicator to the current device.
        torch.cuda.set_device(local)
    init: dict[str, object] = {"backend": default_backend()}
    if timeout_s is not None:
        init["timeout"] = datetime.timedelta(seconds=timeout_s)
    with megatron_world(init, tp, pp, ep, etp, seed=seed, cp=cp):
        yield dist.get_rank()


def _enclosing_world(tp: int, pp: int, ep: int, cp: int = 1) -> int:
    """This rank in a world someone else initialised (and will tear down), after checking its layout."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("torch.distributed is initialised but Megatron's parallel_state is not")
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )
    if have != (tp, pp, ep, cp):
        raise ValueError(
            f"parallel.tp={tp}, parallel.pp={pp}, parallel.ep={ep}, parallel.cp={cp} but the running world's "
            f"Megatron layout is tp={have[0]}, pp={have[1]}, ep={have[2]}, cp={have[3]}"
        )
    return dist.get_rank()
