"""Start-up handshake: rollout and trainer exchange contracts and refuse to run on a mismatch.

Full canonical sections travel, not just hashes, so a refusal names the first differing field
and both values instead of printing two opaque digests. Deployment is exchanged for the log but
never compared: it holds the knobs the claims prove neutral.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_iso.contract.canonical import canonical_json, diff_paths
from megatron_iso.contract.schema import Contract
from megatron_iso.errors import UserError

# Sections a pair must agree on: the policy is the key; semantic catches two different models.
KEYED_SECTIONS = ("numerical_policy", "semantic")


class ContractMismatchError(UserError, RuntimeError):
    """Two sides of the RL loop hold contracts with different numerical policies (or models)."""

    def __init__(self, field: str, local: Any, remote: Any, peer: str, diffs: Sequence[tuple[str, Any, Any]]):
        self.field = field
        self.local = local
        self.remote = remote
        self.peer = peer
        self.diffs = list(diffs)
        more = (
            f" ({len(self.diffs) - 1} more differing fields: {[d[0] for d in self.diffs[1:6]]})"
            if len(diffs) > 1
            else ""
        )
        super().__init__(
            f"contract mismatch with {peer}: first differing field {field}: local={_show(local)} "
            f"{peer}={_show(remote)}{more}; refusing to start"
        )


def _show(v: Any) -> str:
    text = json.dumps(v, sort_keys=True) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 200 else text[:197] + "..."


def contract_diffs(a: Mapping[str, Any], b: Mapping[str, Any], sections: Sequence[str] = KEYED_SECTIONS) -> list:
    """Differing field paths (prefixed by section) between two serialized contracts, policy first."""
    out: list[tuple[str, Any, Any]] = []
    for name in sections:
        out.extend(diff_paths(a.get(name), b.get(name), name))
    return out


def check_compatible(local: Contract | Mapping[str, Any], remote: Contract | Mapping[str, Any], peer: str) -> None:
    """Raise :class:`ContractMismatchError` unless ``local`` and ``remote`` agree on every keyed section."""
    a = local.to_dict() if isinstance(local, Contract) else local
    b = remote.to_dict() if isinstance(remote, Contract) else remote
    diffs = contract_diffs(a, b)
    if diffs:
        path, x, y = diffs[0]
        raise ContractMismatchError(path, x, y, peer, diffs)


@dataclass(frozen=True)
class HandshakeResult:
    peers: dict[str, dict[str, Any]]  # peer name -> its serialized contract (deployment included, for logs)


def _handshake_dist(local: Contract, group: Any) -> HandshakeResult:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("handshake over torch.distributed needs an initialized process group (or pass path=...)")
    payload = local.to_dict()
    size = dist.get_world_size(group)
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, payload, group=group)
    me = dist.get_rank(group)
    # Every rank checks every peer against itself, so the refusal happens on all ranks, not only on
    # the one that happens to hold the odd contract.
    peers = {}
    for rank, theirs in enumerate(gathered):
        if rank == me:
            continue
        theirs = Contract.from_dict(theirs, source=f"rank {rank}").to_dict()
        check_compatible(payload, theirs, f"rank {rank}")
        peers[f"rank {rank}"] = theirs
    return HandshakeResult(peers)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(tmp, path)


def _handshake_file(
    local: Contract, path: Path, role: str, expect: Sequence[str] | None, timeout_s: float, poll_s: float
) -> HandshakeResult:
    path.mkdir(parents=True, exist_ok=True)
    payload = local.to_dict()
    _write_atomic(path / f"{role}.contract.json", canonical_json(payload))
    deadline = time.monotonic() + timeout_s
    wanted = [r for r in (expect or []) if r != role]
    while True:
        missing = [r for r in wanted if not (path / f"{r}.contract.json").exists()]
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"handshake at {path}: no contract from {missing} after {timeout_s:.0f}s "
                f"(expected files {[f'{r}.contract.json' for r in missing]})"
            )
        time.sleep(poll_s)
    peers = {}
    for f in sorted(path.glob("*.contract.json")):
        peer = f.name[: -len(".contract.json")]
        if peer == role:
            continue
        try:
            raw = json.loads(f.read_text(encoding="ascii"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RuntimeError(f"handshake: cannot read {f}: {exc}") from exc
        theirs = Contract.from_dict(raw, source=str(f)).to_dict()
        check_compatible(payload, theirs, f"'{peer}' ({f})")
        peers[peer] = theirs
    return HandshakeResult(peers)


def handshake(
    local: Contract,
    group: Any = None,
    *,
    path: str | os.PathLike[str] | None = None,
    role: str = "trainer",
    expect: Sequence[str] | None = None,
    timeout_s: float = 600.0,
    poll_s: float = 0.2,
) -> HandshakeResult:
    """Exchange contracts with the other side(s) and raise :class:`ContractMismatchError` on a mismatch.

    With ``path`` (separate launches): ``path`` is a rendezvous directory; this side writes
    ``<role>.contract.json`` there, waits up to ``timeout_s`` for each role in ``expect``, then checks
    every other contract present. Without ``path``: all-gather over ``group`` (None = the default
    group); every rank checks every other rank.
    """
    if path is not None:
        # the role becomes a file name in a shared directory; keep it to a safe alphabet
        if not role or not all(ch.isalnum() or ch in "-_." for ch in role) or role.startswith("."):
            raise ValueError(f"handshake: role={role!r} must be letters, digits, '-', '_' or '.' (e.g. 'trainer')")
        if group is not None:
            raise ValueError("handshake: pass either group= or path=, not both")
        return _handshake_file(local, Path(path), role, expect, timeout_s, poll_s)
    return _handshake_dist(local, group)
