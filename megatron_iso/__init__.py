"""megatron_iso: bitwise rollout/trainer parity for Megatron-Core models.

Importing the package checks the interpreter and torch versions up front, so an
unsupported environment fails with a message instead of a deep stack trace, and filters the
warnings Megatron prints about absent optional libraries (``platform.silence_expected_cpu_warnings``).
"""

from __future__ import annotations

import sys

__version__ = "0.1.0"

SUPPORTED_PYTHON = ((3, 10), (3, 13))  # inclusive range of (major, minor)
MIN_TORCH = (2, 6)


def _check_environment() -> None:
    lo, hi = SUPPORTED_PYTHON
    if not (lo <= sys.version_info[:2] <= hi):
        raise RuntimeError(
            f"megatron_iso needs Python {lo[0]}.{lo[1]}..{hi[0]}.{hi[1]}, "
            f"found {sys.version.split()[0]}; create the venv with `make venv` (Python 3.11)."
        )
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only on broken installs
        raise RuntimeError(
            "megatron_iso needs PyTorch; install the pinned CPU wheel first: "
            "`pip install torch==2.13.0` (or run `make venv`)."
        ) from exc
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        raise RuntimeError(
            f"megatron_iso needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}; "
            "install torch==2.13.0."
        )


_check_environment()

from megatron_iso.platform import silence_expected_cpu_warnings  # noqa: E402  (after the environment check)

silence_expected_cpu_warnings()
