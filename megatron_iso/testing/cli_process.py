"""Run ``python -m <module> ...`` (or ``-c`` code, or a script) as a fresh interpreter would, in a process
forked from the multi-rank harness's fork server instead.

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
import types
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_iso.parallel.launch import fork_context


def _run(args: list[str], cwd: str, env: dict[str, str], path: list[str], out: str, err: str) -> None:
    # The fork server's stdout and stderr are the test process's: point fds 1 and 2 at this run's files first.
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # sys.path and sys.argv as the interpreter sets them: the working directory (-m, -c) or the script's
    # directory first, then PYTHONPATH's entries; argv[0] '-c', the script, or (run_module sets it) the module.
    first = cwd if args[0] in ("-m", "-c") else os.path.dirname(os.path.abspath(args[0]))
    sys.path[:0] = [first, *path]
    sys.argv = [args[0], *args[2:]] if args[0] in ("-m", "-c") else list(args)
    # SystemExit(code) becomes the exit code and an exception a traceback with exit 1, as in an interpreter.
    if args[0] == "-m":
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        runpy.run_path(args[0], run_name="__main__")


def run_python(
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    pythonpath: Sequence[str | Path] = (),
    timeout: float = 600.0,
) -> subprocess.CompletedProcess[str]:
    """``python *args`` (``-m module ...``, ``-c code ...`` or ``script ...``) in ``cwd`` with ``env`` (default:
    this process's environment) and ``pythonpath`` ahead of ``PYTHONPATH``, run in a forked process; the result
    as ``subprocess.run`` with ``capture_output=True, text=True`` gives it. Raises ``subprocess.TimeoutExpired``
    past ``timeout``."""
    args = [str(a) for a in args]
    if args[0] in ("-m", "-c") and len(args) < 2:
        raise ValueError(f"run_python: {args[0]} needs an argument: {args}")
    env = dict(os.environ if env is None else env)
    path = [str(p) for p in pythonpath]
    if path:
        env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [env.get("PYTHONPATH")])])
    # The captured output lives outside cwd: tests check that a refused command leaves its directory empty.
    with tempfile.TemporaryDirectory(prefix="cli_process_") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = fork_context().Process(target=_run, args=(args, str(cwd), env, path, out, err), daemon=False)
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["python", *args], timeout)
        with open(out, encoding="utf-8", errors="replace") as f_out, open(err, encoding="utf-8", errors="replace") as f:
            return subprocess.CompletedProcess(["python", *args], proc.exitcode, f_out.read(), f.read())
