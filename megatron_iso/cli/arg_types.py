"""Argument types for the tools' argparse parsers: a bad value is argparse's one usage line (exit 2) that names
the option and its allowed values, instead of a failure later in the run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def _refuse(text: str, allowed: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed values: {allowed}")


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _refuse(text, f"integers >= {low}") from None
        if value < low:
            raise _refuse(text, f"integers >= {low}")
        return value

    return parse


def finite_float(low: float, *, allow_low: bool) -> Callable[[str], float]:
    """A finite number > ``low`` (>= ``low`` with ``allow_low``)."""
    allowed = f"finite numbers {'>=' if allow_low else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _refuse(text, allowed) from None
        if not math.isfinite(value) or value < low or (value == low and not allow_low):
            raise _refuse(text, allowed)
        return value

    return parse


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 0 (token ids), at least one."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise _refuse(text, "comma-separated integers >= 0, e.g. 3,1,4") from None
    if not values or min(values) < 0:
        raise _refuse(text, "comma-separated integers >= 0, e.g. 3,1,4")
    return values


def new_file(text: str) -> str:
    """A file path to write: its directory must exist and the path must not be a directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; allowed values: a file path")
    if not path.resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {path.parent} does not exist")
    return text
