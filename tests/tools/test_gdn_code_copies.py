"""tools/gdn_code_copies.sh: each code copy is profiled by its own bench_gdn.py, with PYTHONPATH at that copy."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gdn_code_copies.sh"

# A stand-in for a copy's bench_gdn.py: prints a kernel row naming its copy and the first PYTHONPATH entry, and
# writes the --out file, as the real one does.
FAKE_BENCH = """
import os, sys
from pathlib import Path
out = sys.argv[sys.argv.index("--out") + 1]
case = sys.argv[sys.argv.index("--profile") + 1]
Path(out).write_text("{}")
print("| _decode_prep_kernel | %s | %s | %s |" % (Path.cwd().name, os.environ["PYTHONPATH"].split(":")[0], case))
print("not a table row")
"""


def _copy(root: Path, name: str) -> Path:
    d = root / name
    (d / "megatron_iso").mkdir(parents=True)
    (d / "megatron_iso" / "__init__.py").write_text("")
    (d / "tools").mkdir()
    (d / "tools" / "bench_gdn.py").write_text(FAKE_BENCH)
    return d


def _run(tmp_path: Path, copies: str, **extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "OUT": str(out), "GDN_COPIES": copies, **extra}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)


def test_each_copy_runs_its_own_bench(tmp_path: Path) -> None:
    a, b = _copy(tmp_path, "base"), _copy(tmp_path, "new")
    res = _run(tmp_path, "base new", GDN_COPY_CASE="decode:8@chunk:bf16")
    assert res.returncode == 0, res.stderr
    assert f"| _decode_prep_kernel | base | {a} | decode:8@chunk:bf16 |" in res.stdout
    assert f"| _decode_prep_kernel | new | {b} | decode:8@chunk:bf16 |" in res.stdout
    assert "not a table row" not in res.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "copy_base_decode_8_chunk_bf16.json",
        "copy_new_decode_8_chunk_bf16.json",
    ]


def test_several_cases_run_for_every_copy(tmp_path: Path) -> None:
    for name in ("base", "new"):
        _copy(tmp_path, name)
    res = _run(tmp_path, "base new", GDN_COPY_CASE="decode:64@chunk:bf16 decodeclose:64@chunk:bf16")
    assert res.returncode == 0, res.stderr
    for case in ("decode:64@chunk:bf16", "decodeclose:64@chunk:bf16"):
        for name in ("base", "new"):
            assert f"| _decode_prep_kernel | {name} | {tmp_path / name} | {case} |" in res.stdout
    assert len(list((tmp_path / "out").iterdir())) == 4  # one profile per (case, copy): none overwrites another


def test_a_folder_without_the_code_is_refused(tmp_path: Path) -> None:
    _copy(tmp_path, "base")
    (tmp_path / "empty").mkdir()
    res = _run(tmp_path, "base empty")
    assert res.returncode == 2 and "empty holds no megatron_iso/" in res.stderr
    assert not any((tmp_path / "out").iterdir())  # refused before the first copy ran
