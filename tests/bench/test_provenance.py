"""A benchmark's JSON names the code that ran: the checkout's commit and a digest of the package's sources."""

from __future__ import annotations

import re
from pathlib import Path

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
    assert ident["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}", ident["commit"])
    assert git_commit(tmp_path) is None  # outside a checkout: no commit rather than a wrong one
