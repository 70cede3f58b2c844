"""Which code a benchmark ran: the git commit of the checkout and a digest of the package's sources.

A benchmark's JSON is evidence for a table in docs/PERFORMANCE.md. The commit alone can mislead: a tree copied
onto a GPU machine may carry a stale ``.git`` (or none), and uncommitted edits do not show in HEAD, so the commit is
marked ``+dirty`` when the package differs from it and left out when the checkout does not track the package. The
digest of every ``*.py`` file under the package (paths and bytes, in sorted order) names the code that actually
ran: equal digests, equal sources, wherever the tree came from.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import megatron_iso

PACKAGE_DIR = Path(megatron_iso.__file__).resolve().parent


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """sha256 over the package's ``*.py`` files: each file's path relative to ``package_dir``, then its bytes."""
    h = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).as_posix()
        h.update(rel.encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _git(where: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def git_commit(where: Path = PACKAGE_DIR) -> str | None:
    """Short HEAD of the checkout holding ``where``, claimed only for sources that checkout tracks: ``SHA`` when
    ``where`` matches HEAD, ``SHA+dirty`` when a file under it differs from HEAD or is untracked, None without git,
    outside a checkout, or when the checkout does not track ``where`` (a copy of the package inside another
    repository's ignored folder would otherwise be credited to that repository's HEAD)."""
    head = _git(where, "rev-parse", "--short", "HEAD")
    if not head or not _git(where, "ls-files", "--", "."):
        return None
    changed = _git(where, "status", "--porcelain", "--", ".")
    return head if changed == "" else f"{head}+dirty"


def code_identity(package_dir: Path = PACKAGE_DIR) -> dict[str, str | None]:
    """``{"commit": ..., "source_sha256": ...}`` for a benchmark's JSON."""
    return {"commit": git_commit(package_dir), "source_sha256": source_digest(package_dir)}


__all__ = ["PACKAGE_DIR", "code_identity", "git_commit", "source_digest"]
