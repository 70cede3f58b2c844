"""tools/h200_call.sh refuses what it cannot run before it installs anything."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "h200_call.sh"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_unknown_step_is_named_with_the_allowed_ones(tmp_path: Path) -> None:
    res = _run(["gdn", "bogus"], {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2
    assert "unknown step 'bogus'" in res.stderr and "gputests" in res.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


def test_out_is_required(tmp_path: Path) -> None:
    res = _run(["gdn"], {"PATH": "/usr/bin:/bin"})
    assert res.returncode != 0 and "OUT must name" in res.stderr
