"""Canonical JSON and SHA-256 identities.

One byte string per value, whatever the process: keys sorted, separators fixed, ASCII only,
and no decimal floats anywhere (a float's repr is a formatting choice, its bit pattern is not;
``registry.float_bits`` turns floats into bit patterns before they get here). Anything outside
JSON's exact types is rejected with the path of the offending field instead of being coerced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from megatron_iso.registry import float_bits


class CanonicalError(TypeError):
    """A value cannot be serialized canonically (a float, a non-string key, an unknown type)."""


def check_canonical(value: Any, path: str = "$") -> None:
    """Raise :class:`CanonicalError` naming the first field that canonical JSON cannot hold exactly."""
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, float):
        raise CanonicalError(
            f"{path} = {value!r}: canonical JSON forbids decimal floats; store it as a bit pattern "
            "with megatron_iso.registry.float_bits()"
        )
    if isinstance(value, int):
        return
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise CanonicalError(f"{path}: key {key!r} is {type(key).__name__}, canonical JSON keys are strings")
            check_canonical(value[key], f"{path}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_canonical(item, f"{path}[{i}]")
        return
    raise CanonicalError(f"{path}: type {type(value).__name__} has no canonical JSON form")


def canonical_json(value: Any) -> str:
    """The canonical text of ``value``: what identities hash and what files store."""
    check_canonical(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_of(value: Any) -> str:
    """Hex SHA-256 of the canonical text of ``value``."""
    return hashlib.sha256(canonical_json(value).encode("ascii")).hexdigest()


def to_canonical(value: Any, path: str = "$") -> Any:
    """Convert config-like data (plain dicts and lists: ``settings.compose.plain_config``) into canonical form.

    Floats become bit patterns; tuples become lists; everything else must already be exact.
    """
    if isinstance(value, float):
        return float_bits(value)
    if isinstance(value, Mapping):
        return {str(k): to_canonical(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    check_canonical(value, path)
    return value


_ABSENT = "<absent>"


def diff_paths(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Every leaf where ``a`` and ``b`` differ, as (dotted path, a value, b value), in canonical (sorted) order.

    A key present on one side only is reported with the value ``"<absent>"`` on the other side.
    """
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a:
                out.append((sub, _ABSENT, b[key]))
            elif key not in b:
                out.append((sub, a[key], _ABSENT))
            else:
                out.extend(diff_paths(a[key], b[key], sub))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out.extend(diff_paths(x, y, f"{path}[{i}]"))
        return out
    # 1 == True in Python, but they are different canonical values. (Not `type(a) is type(b)`: str
    # subclasses such as torch's TorchVersion must compare equal to the plain str read from a file.)
    if isinstance(a, bool) != isinstance(b, bool) or a != b:
        return [(path or "$", a, b)]
    return []
