"""A benchmark's JSON names the code that ran: the checkout's commit and a digest of the package's sources."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatron_iso.bench.provenance import PACKAGE_DIR, code_identity, git_commit, source_digest


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_digest_follows_python_sources_only(tmp_path: Path) -> None:
    base = source_digest(_tree(tmp_path / "a", {"x.py": "A = 1\n", "sub/y.py": "B = 2\n", "notes.txt": "one"}))
    same = source_digest(_tree(tmp_path / "b", {"x.py": "A = 1\n", "sub/y.py": "B = 2\n", "notes.txt": "two"}))
    edited = source_digest(_tree(tmp_path / "c", {"x.py": "A = 1\n", "sub/y.py": "B = 3\n"}))
    moved = source_digest(_tree(tmp_path / "d", {"x.py": "A = 1\n", "sub/z.py": "B = 2\n"}))
    assert base == same  # another folder, the same sources; non-Python files do not count
    assert len({base, edited, moved}) == 3  # one byte, or one file's path, changes the digest


def test_identity_of_the_installed_package(tmp_path: Path) -> None:
    ident = code_identity()
    assert ident["source_sha256"] == source_digest(PACKAGE_DIR)
    assert re.fullmatch(r"[0-9a-f]{64}", ident["source_sha256"] or "")
    assert ident["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", ident["commit"])
    assert git_commit(tmp_path) is None  # outside a checkout: no commit rather than a wrong one


def _git(root: Path, *args: str) -> str:
    env = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", "-C", str(root), *env, *args], check=True, capture_output=True, text=True).stdout


def test_commit_is_claimed_only_for_the_sources_it_tracks(tmp_path: Path) -> None:
    try:
        _git(tmp_path, "init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not installed")
    pkg = _tree(tmp_path / "pkg", {"x.py": "A = 1\n"})
    _tree(tmp_path, {".gitignore": "copy/\n"})
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "c")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD").strip()
    assert git_commit(pkg) == head
    (pkg / "x.py").write_text("A = 2\n")  # an uncommitted edit: not HEAD's sources
    assert git_commit(pkg) == f"{head}+dirty"
    (pkg / "x.py").write_text("A = 1\n")
    (pkg / "new.py").write_text("B = 1\n")  # an untracked source file counts too
    assert git_commit(pkg) == f"{head}+dirty"
    copy = _tree(tmp_path / "copy" / "pkg", {"x.py": "A = 3\n"})  # a copy in an ignored folder of the checkout
    assert git_commit(copy) is None
