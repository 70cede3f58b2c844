"""The project's user-facing failures, apart from its own bugs.

``UserError`` marks an exception whose message is the whole story for the person who ran the
command (a bad setting, a missing or damaged file, a run directory in use, a non-finite value): the
command-line tools print it as one line and exit with their usage-error code instead of a traceback.
Everything else is an internal failure and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class UserError(Exception):
    """A failure the user can fix from the message alone; CLIs print it without a traceback."""


class NonFiniteError(UserError, FloatingPointError):
    """A NaN or Inf where the run needs finite numbers (weights, logits, loss, gradient norm)."""


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an Inf (one device reduction per tensor)."""
    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def check_finite(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise :class:`NonFiniteError` naming the first tensors of ``named`` that are not finite."""
    bad = nonfinite_names(named)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteError(f"{what}: NaN or Inf in {', '.join(bad[:3])}{more}")
