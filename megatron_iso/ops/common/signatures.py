"""Backend signatures: the call every implementation of an op answers, declared once per op family.

Each family's ``backend.py`` writes a ``typing.Protocol`` per registered op (its ``__call__`` is the signature
the family's dispatch point calls ``select(...)``'s result with) and lists them in ``SIGNATURES``. This module
holds that record and the one check that a function matches it; ``tests/ops/test_backend_signatures.py`` runs
the check over every implementation in the registry, the Triton ones included.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Signature:
    """The backend signature of one registered op."""

    op: str  # the registry's op name, e.g. "rmsnorm"
    protocol: type  # a Protocol whose ``__call__`` every implementation of ``op`` matches
    # impl_id -> keyword-only parameters that implementation takes beyond the protocol's (tile configs and other
    # knobs that benches and tests pass to it directly). Each needs a default: the dispatch point never passes it.
    extras: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def protocol_parameters(protocol: type, member: str = "__call__") -> list[inspect.Parameter]:
    """The parameters of ``protocol.member`` without ``self``."""
    params = list(inspect.signature(getattr(protocol, member)).parameters.values())
    return params[1:]


def signature_mismatches(
    expected: list[inspect.Parameter], fn: Callable[..., Any], extras: tuple[str, ...] = ()
) -> list[str]:
    """What keeps ``fn`` from answering the call ``expected`` describes (empty: it matches).

    The positional parameters: the same names in the same order, and a default wherever the protocol has one.
    The keyword-only ones: every one the protocol names (a default where it has one); others only when listed in
    ``extras``, each with a default. No ``*args`` / ``**kwargs`` on either side: they would hide a mismatch."""
    got = list(inspect.signature(fn).parameters.values())
    problems = []
    variadic = [p.name for p in (*expected, *got) if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        problems.append(f"variadic parameters {variadic}")
    want_pos = [p for p in expected if p.kind in _POSITIONAL]
    got_pos = [p for p in got if p.kind in _POSITIONAL]
    if [p.name for p in got_pos] != [p.name for p in want_pos]:
        problems.append(f"positional {[p.name for p in got_pos]}, expected {[p.name for p in want_pos]}")
    want_kw = {p.name: p for p in expected if p.kind == p.KEYWORD_ONLY}
    got_kw = {p.name: p for p in got if p.kind == p.KEYWORD_ONLY}
    missing = sorted(set(want_kw) - set(got_kw))
    if missing:
        problems.append(f"keyword-only {missing} missing")
    undeclared = sorted(set(got_kw) - set(want_kw) - set(extras))
    if undeclared:
        problems.append(f"keyword-only {undeclared} not in the protocol nor declared as this implementation's extras")
    for want in [*want_pos, *want_kw.values()]:
        have = next((p for p in got if p.name == want.name), None)
        if have is not None and want.default is not want.empty and have.default is have.empty:
            problems.append(f"'{want.name}' has no default, the protocol gives it one")
    unset = sorted(n for n in extras if n in got_kw and got_kw[n].default is got_kw[n].empty)
    if unset:
        problems.append(f"extra keyword-only {unset} without a default")
    return problems


__all__ = ["Signature", "protocol_parameters", "signature_mismatches"]
