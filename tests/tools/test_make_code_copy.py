"""tools/make_code_copy.sh: a copy of a revision with patches applied, refused loudly when a patch applies to nothing."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "make_code_copy.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("patch") is None or not (ROOT / ".git").exists(), reason="needs patch(1) and a git checkout"
)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def _patch(tmp_path: Path, path: str, old: str, new: str) -> Path:
    p = tmp_path / f"{len(list(tmp_path.iterdir()))}.patch"
    p.write_text(f"--- a/{path}\n+++ b/{path}\n@@ -1,1 +1,1 @@\n-{old}\n+{new}\n")
    return p


def test_copy_holds_the_revision_with_its_patch(tmp_path: Path) -> None:
    first = subprocess.run(
        ["git", "show", "HEAD:megatron_iso/__init__.py"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.splitlines()[0]
    res = _run(str(tmp_path / "v" / "new"), "HEAD", str(_patch(tmp_path, "megatron_iso/__init__.py", first, "# x")))
    assert res.returncode == 0, res.stderr
    copy = tmp_path / "v" / "new"
    assert (copy / "megatron_iso" / "__init__.py").read_text().splitlines()[0] == "# x"
    for part in ("tools/bench_gdn.py", "tests/gpu", "conf/config.yaml", "pyproject.toml"):
        assert (copy / part).exists(), part  # the copy runs its own bench and GPU tests
    again = _run(str(copy), "HEAD")
    assert again.returncode == 2 and "exists; remove it first" in again.stderr


def test_a_patch_that_does_not_apply_fails(tmp_path: Path) -> None:
    stale = _patch(tmp_path, "megatron_iso/__init__.py", "a line this file does not have", "# x")
    res = _run(str(tmp_path / "c1"), "HEAD", str(stale))
    assert res.returncode == 1 and "does not apply to HEAD" in res.stderr
    missing = _run(str(tmp_path / "c2"), "HEAD", str(tmp_path / "none.patch"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
