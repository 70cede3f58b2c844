"""``iso.lock.json``: the contract plus golden probe digests, sealed with a self-digest.

A lockfile answers "does this checkout still compute what it computed when the lock was
written?": every registered implementation's probe runs on its fixed seeded inputs and each
output's raw bytes are hashed. A kernel change that moves one bit changes a digest, so it is
caught before a run, not in the middle of RL. The self-digest covers everything else in the file,
so an edited or truncated lock is rejected instead of being trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_iso import registry
from megatron_iso.contract.canonical import canonical_json, sha256_of
from megatron_iso.contract.handshake import contract_diffs
from megatron_iso.contract.schema import Contract, ContractFormatError
from megatron_iso.errors import UserError
from megatron_iso.registry import OpImpl

LOCK_VERSION = 1
LOCK_KEYS = ("lock_version", "contract", "overrides", "probes", "self_digest")
# Every probe starts from the same global RNG state, so a probe that forgets its own generator
# still gives the same inputs on every run.
PROBE_SEED = 0


class LockfileError(UserError, ValueError):
    """The lockfile is unreadable, malformed, edited by hand or corrupted."""


def tensor_digest(t: Any) -> dict[str, Any]:
    """SHA-256 of a tensor's raw bytes (row-major, on CPU) plus its dtype and shape."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"probe outputs must be torch tensors, got {type(t).__name__}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {
        "sha256": hashlib.sha256(raw).hexdigest(),
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
    }


def run_probes(impls: Iterable[OpImpl]) -> dict[str, dict[str, dict[str, Any]]]:
    """{op: {output name: digest}} for every implementation that has a probe."""
    import torch

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for impl in sorted(impls, key=lambda i: i.op):
        if impl.probe is None:
            continue
        torch.manual_seed(PROBE_SEED)
        try:
            result = impl.probe()
        except Exception as exc:
            raise RuntimeError(f"probe of op '{impl.op}' ({impl.ref}) failed: {type(exc).__name__}: {exc}") from exc
        if isinstance(result, torch.Tensor):
            result = {"out": result}
        if not isinstance(result, Mapping):
            raise TypeError(
                f"probe of op '{impl.op}' ({impl.ref}) returned {type(result).__name__}, expected a mapping"
            )
        out[impl.op] = {str(name): tensor_digest(result[name]) for name in sorted(result)}
    return out


def _contract_impls(contract: Contract) -> list[OpImpl]:
    pol = contract.numerical_policy
    return registry.registered(device_class=pol.device_class, profile=pol.profile)


def make_lock(
    contract: Contract, overrides: Sequence[str] = (), impls: Iterable[OpImpl] | None = None
) -> dict[str, Any]:
    """The lock document for ``contract`` (probes run now)."""
    body = {
        "lock_version": LOCK_VERSION,
        "contract": contract.to_dict(),
        # The overrides the contract was built from, so `verify` can rebuild the same contract.
        "overrides": list(overrides),
        "probes": run_probes(_contract_impls(contract) if impls is None else impls),
    }
    body["self_digest"] = sha256_of(body)
    return body


def write_lock(path: str | os.PathLike[str], contract: Contract, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Write ``iso.lock.json`` (canonical JSON, so the file itself is byte-stable) and return it."""
    lock = make_lock(contract, overrides)
    Path(path).write_text(canonical_json(lock) + "\n", encoding="ascii")
    return lock


def read_lock(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and authenticate a lockfile; raise :class:`LockfileError` with the reason on any defect."""
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii")
    except FileNotFoundError:
        raise LockfileError(f"{p}: no such lockfile; create it with `iso-contract lock --out {p}`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LockfileError(f"{p}: cannot read lockfile ({exc})") from exc
    try:
        lock = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LockfileError(f"{p}: not valid JSON ({exc}); the lockfile is corrupted, regenerate it") from exc
    if not isinstance(lock, dict) or sorted(lock) != sorted(LOCK_KEYS):
        have = sorted(lock) if isinstance(lock, dict) else type(lock).__name__
        raise LockfileError(f"{p}: expected exactly the keys {sorted(LOCK_KEYS)}, found {have}")
    if lock["lock_version"] != LOCK_VERSION:
        raise LockfileError(
            f"{p}: lock_version {lock['lock_version']!r} unsupported (this build writes {LOCK_VERSION})"
        )
    body = {k: v for k, v in lock.items() if k != "self_digest"}
    try:
        actual = sha256_of(body)
    except TypeError as exc:  # a float or odd type slipped in by hand
        raise LockfileError(f"{p}: content is not canonical ({exc})") from exc
    if actual != lock["self_digest"]:
        raise LockfileError(
            f"{p}: self_digest mismatch (stored {lock['self_digest']!r}, content hashes to {actual!r}): "
            "the file was edited by hand or corrupted; regenerate it with `iso-contract lock`"
        )
    try:
        Contract.from_dict(lock["contract"], source=f"{p}: contract")
    except ContractFormatError as exc:
        raise LockfileError(str(exc)) from exc
    return lock


@dataclass
class VerifyReport:
    """Result of :func:`verify_lock`: ``ok`` only when the contract and every probe digest match."""

    contract_diffs: list[tuple[str, Any, Any]] = field(default_factory=list)
    # (op, output name, what happened: "diverged" | "missing" | "new", locked digest, current digest)
    probe_mismatches: list[tuple[str, str, str, Any, Any]] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.contract_diffs and not self.probe_mismatches

    def lines(self) -> list[str]:
        out = [f"contract field {p}: lock={json.dumps(a)} current={json.dumps(b)}" for p, a, b in self.contract_diffs]
        for op, name, what, old, new in self.probe_mismatches:
            old_s = old["sha256"][:16] if isinstance(old, dict) else old
            new_s = new["sha256"][:16] if isinstance(new, dict) else new
            out.append(f"probe {op}/{name}: {what} (lock {old_s}, current {new_s})")
        return out


def compare_probes(locked: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, str, str, Any, Any]]:
    out = []
    for op in sorted(set(locked) | set(current)):
        a, b = locked.get(op, {}), current.get(op, {})
        for name in sorted(set(a) | set(b)):
            if name not in b:
                out.append((op, name, "missing", a[name], None))
            elif name not in a:
                out.append((op, name, "new", None, b[name]))
            elif a[name] != b[name]:
                out.append((op, name, "diverged", a[name], b[name]))
    return out


def verify_lock(path: str | os.PathLike[str], current: Contract) -> VerifyReport:
    """Compare ``current`` (the contract rebuilt now, by default from the lock's own ``overrides``) with the
    lock and rerun the probes of its implementations.

    Raises :class:`LockfileError` if the lock itself cannot be trusted. Deployment differences are
    ignored (neutral by the claims); semantic and numerical_policy differences are reported.
    """
    lock = read_lock(path)
    report = VerifyReport()
    report.contract_diffs = contract_diffs(lock["contract"], current.to_dict())
    probes = run_probes(_contract_impls(current))
    report.checked = sum(len(v) for v in probes.values())
    report.probe_mismatches = compare_probes(lock["probes"], probes)
    return report
