"""tools/gpu_bench.sh refuses what it cannot run before it installs or writes anything."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_bench.sh"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_unknown_step_is_named_with_the_allowed_ones(tmp_path: Path) -> None:
    res = _run(["gdn", "bogus"], {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2
    assert "unknown step 'bogus'" in res.stderr and "gputests" in res.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


def test_output_folder_is_required(tmp_path: Path) -> None:
    res = _run(["gdn"], {"PATH": "/usr/bin:/bin"})
    assert res.returncode == 2 and "no output folder" in res.stderr


def test_output_folder_as_an_argument(tmp_path: Path) -> None:
    out = tmp_path / "results"
    res = _run(["-o", str(out), "bogus"], {"PATH": "/usr/bin:/bin"})
    assert res.returncode == 2 and "unknown step 'bogus'" in res.stderr
    assert not out.exists()  # refused before the folder was made


def test_no_steps_runs_nothing_and_makes_the_folder(tmp_path: Path) -> None:
    out = tmp_path / "results"
    res = _run(["--out", str(out)], {"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert out.is_dir() and not any(out.iterdir())
