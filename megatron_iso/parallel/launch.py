"""Run a function on N gloo ranks with a Megatron parallel layout and collect each rank's result.

The one local multi-rank launcher: every multi-rank test (through the re-export in
``megatron_iso.testing.harness``) and ``iso-bench`` / ``iso-bisect`` (one process group per layout)
go through :func:`run_on_ranks`. It spawns ``world_size`` processes,
initialises ``torch.distributed`` (gloo), applies the CPU platform patches, initialises
Megatron's ``parallel_state`` with the requested TP/PP/EP sizes, seeds Megatron's RNG tracker,
calls ``fn(*args)`` and returns the per-rank results in rank order. A failure on any rank is
re-raised here with that rank's traceback.

:func:`megatron_iso.parallel.torchrun.run_under_torchrun` is its twin for GPUs: the same call shape
and per-rank setup, with the ranks started by ``torchrun`` (one process per GPU, NCCL).
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_iso.parallel.world import free_port, megatron_world


class RankFailure(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _dumps(obj: Any) -> bytes:
    # Serialise through torch.save so tensors travel as bytes, not shared-memory handles.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# Modules the fork server imports once; every rank then forks from it instead of paying the
# several-second Megatron import per process (spawn would).
_PRELOAD = ["megatron_iso.testing.preload"]


def fork_context() -> Any:
    """The start context of every local rank (and of ``testing.cli_process``'s command-line runs): the fork
    server with :data:`_PRELOAD` imported, or plain spawn where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    layout: dict[str, Any],
    seed: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    queue: Any,
) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        torch.set_num_threads(cpu_threads_per_rank(world_size))

        init: dict[str, Any] = {"backend": "gloo", "rank": rank, "world_size": world_size}
        if layout.get("collective_timeout_s") is not None:
            init["timeout"] = datetime.timedelta(seconds=layout["collective_timeout_s"])
        with megatron_world(init, layout["tp"], layout["pp"], layout["ep"], layout["etp"], seed, layout["cp"]):
            result = fn(*args)
            queue.put((rank, True, _dumps(result)))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))


def cpu_threads_per_rank(world_size: int) -> int:
    """Intra-op threads for one of ``world_size`` CPU ranks on this machine: its share of the cores
    (oversubscribed threads make a 2-core machine crawl). Every launcher sets it the same way."""
    return max(1, (os.cpu_count() or 1) // world_size)


def check_layout(who: str, world_size: int, tp: int, pp: int, ep: int, etp: int, cp: int = 1) -> None:
    """Refuse a layout no launcher can start, naming the field (``who`` names the launcher)."""
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{who}: {name}={value!r} must be a positive int")
    if world_size % (tp * pp * cp):
        raise ValueError(f"{who}: tp*pp*cp={tp * pp * cp} does not divide world_size={world_size}")


_POLL_S = 1.0


def _silent_deaths(procs: Sequence[Any], results: dict[int, Any], queue: Any) -> list[str]:
    """Ranks that exited without reporting (killed, or failed before their try block, e.g. while the
    child re-imported an unguarded ``__main__``): fail now instead of waiting out the timeout."""
    dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
    if not dead:
        return []
    time.sleep(_POLL_S)  # a rank that reported just before exiting: its message may still be in flight
    if not queue.empty():
        return []
    return [
        f"--- rank {r} ---\nexited with code {procs[r].exitcode} without reporting a result "
        "(see its stderr; a script that starts ranks needs an `if __name__ == '__main__':` guard)"
        for r in dead
    ]


def run_on_ranks(
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
    collective_timeout_s: float | None = None,
    cp: int = 1,
) -> list[Any]:
    """Call module-level ``fn(*args)`` on ``world_size`` gloo ranks; return results in rank order.

    ``tp * pp`` must divide ``world_size`` (the rest is data parallel); ``ep`` must divide the
    data-parallel-times-TP product as Megatron requires. ``etp`` is the expert tensor-parallel size
    (1, as ``models.transformer_config`` configures MoE models: an expert lives whole on one EP rank).
    ``collective_timeout_s``: the world's collective timeout (``dist_timeout_s``; torch's default when None).
    ``cp``: the context-parallel size (``tp * pp * cp`` must divide ``world_size``).
    """
    check_layout("run_on_ranks", world_size, tp, pp, ep, etp, cp)
    ctx = fork_context()
    queue = ctx.Queue()
    port = free_port()
    layout = {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "cp": cp, "collective_timeout_s": collective_timeout_s}
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, layout, seed, fn, tuple(args), queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not failures:
            try:
                rank, ok, payload = queue.get(timeout=_POLL_S)
            except queue_mod.Empty:
                failures += _silent_deaths(procs, results, queue)
                if time.monotonic() > deadline:
                    failures.append(
                        f"--- timeout ---\nno result from ranks {sorted(set(range(world_size)) - set(results))}"
                    )
                continue
            if ok:
                results[rank] = _loads(payload)
            else:
                # the others may be blocked in a collective with the failed rank
                failures.append(f"--- rank {rank} ---\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if failures else timeout)
            if p.is_alive():
                p.terminate()
    if failures:
        raise RankFailure("a rank failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]
