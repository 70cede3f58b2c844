"""Run a command-line tool as ``python -m <module> ...`` would, in a process forked from the multi-rank
harness's fork server instead of a fresh interpreter.

A fresh ``python -m megatron_iso.cli.train`` spends 6-8 s importing torch and Megatron before it reads its
first argument; tests that feed a tool dozens of bad command lines paid that once per line. The fork server
(``parallel.launch.fork_context``) has those modules imported already (``testing.preload``), so each run
here starts in milliseconds and is still its own process: its own exit code, its own stdout and stderr at the
file-descriptor level (a C library's or a traceback's output included), its own working directory and
environment, and nothing it does reaches the test's process or the next run.

What differs from a fresh interpreter: the preloaded modules are imported before the tool starts (with the CPU
patches and warning filters they install, which every CPU run installs itself), and an uncaught exception is
printed by ``multiprocessing`` (a ``Process ...:`` line, then the traceback) before the exit code 1. The
console entry point itself is not exercised: keep one real ``subprocess`` run per tool for that.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_iso.parallel.launch import fork_context


def _run_module(
    module: str, args: list[str], cwd: str, env: dict[str, str], path: list[str], out: str, err: str
) -> None:
    # The fork server's stdout and stderr are the test process's: point fds 1 and 2 at this run's files first.
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [cwd, *path]  # as `python -m`: the working directory first, then PYTHONPATH's entries
    sys.argv = [module, *args]
    # SystemExit(code) becomes the exit code and an exception a traceback with exit 1, as in an interpreter.
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_cli_module(
    module: str,
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    pythonpath: Sequence[str | Path] = (),
    timeout: float = 600.0,
) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` in ``cwd`` with ``env`` (default: this process's environment) and
    ``pythonpath`` ahead of ``PYTHONPATH``, run in a forked process; the result as ``subprocess.run`` with
    ``capture_output=True, text=True`` gives it. Raises ``subprocess.TimeoutExpired`` past ``timeout``."""
    env = dict(os.environ if env is None else env)
    path = [str(p) for p in pythonpath]
    if path:
        env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [env.get("PYTHONPATH")])])
    argv = ["python", "-m", module, *args]
    # The captured output lives outside cwd: tests check that a refused command leaves its directory empty.
    with tempfile.TemporaryDirectory(prefix="cli_process_") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = fork_context().Process(
            target=_run_module, args=(module, list(args), str(cwd), env, path, out, err), daemon=False
        )
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        with open(out, encoding="utf-8", errors="replace") as f_out, open(err, encoding="utf-8", errors="replace") as f:
            return subprocess.CompletedProcess(argv, proc.exitcode, f_out.read(), f.read())
