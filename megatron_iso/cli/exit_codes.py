"""Exit codes and error reporting shared by the command-line tools.

Every tool keeps its outcome codes apart from its failures:

- 0: done, and the answer is yes (the run finished, the contracts match, the candidate passed);
- 1: done, and the answer is no (the tool's documented negative outcome: contracts differ, a divergence
  was found, the gate refused the candidate);
- 2: usage error: a bad argument, setting or input file, or a run that cannot start or continue as asked.
  One line on stderr names the problem; no traceback;
- 3: the run stopped on a NaN or Inf (``NonFiniteError``), one line on stderr;
- 4: internal failure: a bug or an unexpected error, with its traceback.

``--debug`` (or ``HYDRA_FULL_ERROR=1``) re-raises every error with its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from megatron_iso.errors import NonFiniteError, UserError

EXIT_OK = 0
EXIT_NO = 1
EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_INTERNAL = 4


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get("HYDRA_FULL_ERROR") == "1"


def is_usage_error(exc: BaseException) -> bool:
    """A :class:`UserError`, or a Hydra / OmegaConf error about the config (an override, a missing key)."""
    return isinstance(exc, UserError) or type(exc).__module__.split(".")[0] in ("hydra", "omegaconf")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def report(prog: str, exc: BaseException) -> int:
    """Print ``exc`` as the tool's users should see it and return the exit code it maps to."""
    if isinstance(exc, NonFiniteError):
        print(f"{prog}: stopped: {one_line(exc)}", file=sys.stderr)
        return EXIT_NONFINITE
    if is_usage_error(exc):
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    traceback.print_exception(exc)
    print(f"{prog}: internal error ({type(exc).__name__}); the traceback above is for a bug report", file=sys.stderr)
    return EXIT_INTERNAL


def run_cli(prog: str, body: Callable[[], int], *, debug: bool = False) -> int:
    """``body()``'s exit code, or the code of the error it raised (see the module doc)."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug_requested(debug):
            raise
        return report(prog, exc)
