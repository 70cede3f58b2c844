"""Checks every settings group shares: the error type and the validators that name the field and its allowed values,
and the run-level fields (``resume``, ``out_dir``, ``logger``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_iso.contract.build import ContractValidationError
from megatron_iso.errors import UserError

# resume=false starts a run, true continues the latest checkpoint (an error without one), auto either.
RESUME_MODES = ("false", "true", "auto")


class SettingsError(UserError, ValueError):
    """A setting outside its allowed values; the message names the field and the values."""


def resume_mode(value: Any) -> str:
    """``resume`` as one of :data:`RESUME_MODES` (Hydra reads ``true`` / ``false`` as booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    if text not in RESUME_MODES:
        raise SettingsError(f"resume={value!r} is not allowed; allowed values: {list(RESUME_MODES)}")
    return text


def check_out_dir(value: Any) -> Path | None:
    """``out_dir`` as a path; None (the default) lets the run make a new ``runs/<UTC time>-<id>``."""
    if value is None:
        return None
    if not str(value).strip():
        raise SettingsError(
            f"out_dir={value!r} is not allowed; allowed values: a directory path, or null for a new runs/<time>-<id>"
        )
    return Path(str(value))


LOGGERS = ("none", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


def check_logger(logger: Mapping[str, Any] | None) -> tuple[str, str]:
    """``(logger.name, logger.mode)`` checked (mode: W&B's; offline unless set)."""
    name = _choice(_get(logger, "name", "none"), "logger.name", LOGGERS)
    mode = _choice(_get(logger, "mode", "offline"), "logger.mode", WANDB_MODES)
    return name, mode


def _int(value: Any, field_name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; anything else names the field and what it takes."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: integers >= {minimum}")
    return value


def _positive(value: Any, field_name: str, zero: bool = False) -> float:
    """``value`` as a finite float > 0 (>= 0 with ``zero``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not (ok and float(value) < float("inf")):
        bound = ">= 0" if zero else "> 0"
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: finite numbers {bound}")
    return float(value)


def _bool(value: Any, field_name: str) -> bool:
    """``value`` as a bool: true or false only (``bool('yes')`` is True, so a cast would accept any typo)."""
    if not isinstance(value, bool):
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: true or false")
    return value


def _number(value: Any, field_name: str, low: float | None = None, *, open_low: bool = False) -> float:
    """``value`` as a finite float (>= ``low``, or > ``low`` with ``open_low``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if open_low else value >= low
    if not ok:
        bound = "" if low is None else f" {'>' if open_low else '>='} {low:g}"
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: finite numbers{bound}")
    return float(value)


# The smallest sampling temperature: logits are divided by it in fp32 (largest finite value 3.4e38). At 1e-30 a
# logit up to 3.4e8 stays finite, orders of magnitude beyond any logit a model produces; at 1e-40 (an fp32
# subnormal) a logit of 1 already overflows to inf and every logprob is NaN.
MIN_TEMPERATURE = 1e-30


def check_temperature(value: Any, field_name: str, *, zero: bool = False) -> float:
    """A sampling temperature: a finite number >= :data:`MIN_TEMPERATURE` (or 0 = greedy, with ``zero``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value >= MIN_TEMPERATURE or (zero and value == 0)):
        return float(value)
    greedy = "0 (greedy) or " if zero else ""
    raise SettingsError(
        f"{field_name}={value!r} is not allowed; allowed values: {greedy}finite numbers >= {MIN_TEMPERATURE:g} "
        f"(logits are divided by it in fp32: below {MIN_TEMPERATURE:g} logit/temperature overflows to inf and "
        "the logprobs are NaN)"
    )


def _required(group: Mapping[str, Any], key: str, group_name: str) -> Any:
    """``group[key]``, which every option of the group sets; a missing or null one names the key (a KeyError or
    ``int(None)`` would be a traceback)."""
    value = group.get(key)
    if value is None:
        raise SettingsError(
            f"{group_name}.{key} is {'null' if key in group else 'missing'}; it needs a value (the shipped configs, "
            "conf/, set one)"
        )
    return value


def _choice(value: Any, field_name: str, allowed: tuple[str, ...]) -> str:
    if str(value) not in allowed:
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: {list(allowed)}")
    return str(value)


def _get(group: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    """``group[key]``, or ``default`` when the group, the key or its value is missing (null)."""
    value = None if group is None else group.get(key)
    return default if value is None else value


def _group(c: Mapping[str, Any], key: str) -> dict[str, Any]:
    group = c.get(key)
    if not isinstance(group, Mapping):
        raise ContractValidationError(f"config has no '{key}' group; compose the root config (conf/config.yaml)")
    return dict(group)
