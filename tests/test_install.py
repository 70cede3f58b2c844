"""megatron_iso as a user gets it: a non-editable ``pip install`` into a fresh virtual environment, run
from a directory that is not the checkout. Its commands must find the configs (and example data) the
package ships, write nothing into the working directory, and keep stderr free of warnings. The configs live
in the checkout's top-level ``conf/``, which setup.py installs as ``megatron_iso/conf/``; an editable install
(``make venv``) and a plain source checkout read ``conf/`` where it is.

The new environment borrows this one's third-party packages through a ``.pth`` line naming this
environment's site-packages. Python appends such a line to ``sys.path`` without running the ``.pth``
files inside that directory, so this checkout's editable install (a ``.pth`` import hook) stays out of it;
the tests assert that ``megatron_iso`` is imported from the new environment's own site-packages.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What `pip install <repo>` reads: the build files and the package (tests, tools and docs stay behind).
SOURCES = ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "megatron_iso", "conf")
CONF_QUERY = (
    "import megatron_iso, megatron_iso.settings.compose as c; print(megatron_iso.__file__); print(c.conf_dir())"
)
TINY = [
    "model=tiny_dense",
    "rl.steps=1",
    "rl.group_size=2",
    "rl.max_response_length=2",
    "task.prompts_per_step=2",
    "logger=none",
]
# Lines a clean run must not print: Python and library warnings, Megatron's INFO records, tracebacks.
NOISE = re.compile(r"warn|\bINFO\b|Traceback", re.IGNORECASE)


def _env() -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONWARNINGS", "HYDRA_FULL_ERROR", "VIRTUAL_ENV", "MEGATRON_ISO_CONF")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


class Installed:
    def __init__(self, venv: Path, site: Path) -> None:
        self.venv, self.site = venv, site
        self.python = venv / "bin" / "python"

    def script(self, name: str) -> str:
        return str(self.venv / "bin" / name)


def _install(root: Path, *mode: str) -> Installed:
    """A fresh virtual environment under ``root`` with a copy of the checkout installed by pip (``mode``:
    pip's extra flags, e.g. ``-e``)."""
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=_env())
    installed = Installed(venv, Path())
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(installed.python), "-c", query], cwd=root).stdout.strip())
    assert site.is_dir() and site.is_relative_to(venv), site
    installed.site = site
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "_megatron_iso_test_deps.pth").write_text("".join(f"{path}\n" for path in ours))
    pip = [str(installed.python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = _run([*pip, "--ignore-installed", "--quiet", *mode, str(src)], cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return installed


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    return _install(tmp_path_factory.mktemp("install"))


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_the_installed_copy_is_the_one_imported_with_its_configs(installed: Installed, tmp_path: Path) -> None:
    proc = _run([str(installed.python), "-c", CONF_QUERY], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, conf = (Path(line) for line in proc.stdout.split())
    assert module.is_relative_to(installed.site), f"megatron_iso imported from {module}, not the new environment"
    assert conf == installed.site / "megatron_iso" / "conf"
    shipped = _files(conf)  # every config and the example data beside them
    assert shipped == _files(REPO / "conf") and "task/arith.jsonl" in shipped


def test_the_checkout_keeps_its_configs_at_the_top() -> None:
    """The design card's layout: ``conf/`` beside ``megatron_iso/``, not inside it; a source checkout reads it."""
    from megatron_iso.settings.compose import conf_dir

    assert (REPO / "conf" / "config.yaml").is_file() and not (REPO / "megatron_iso" / "conf").exists()
    assert conf_dir() == REPO / "conf"


def test_an_editable_install_reads_the_checkouts_conf(tmp_path: Path) -> None:
    """``make venv`` installs with ``pip install -e``: its modules and its configs are the checkout's."""
    editable = _install(tmp_path, "-e")
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    proc = _run([str(editable.python), "-c", CONF_QUERY], cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, conf = (Path(line) for line in proc.stdout.split())
    assert module == tmp_path / "src" / "megatron_iso" / "__init__.py"
    assert conf == tmp_path / "src" / "conf"


def test_a_conf_override_without_a_root_config_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_iso.settings.compose import conf_dir

    monkeypatch.setenv("MEGATRON_ISO_CONF", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"\$MEGATRON_ISO_CONF=.* has no config\.yaml; point"):
        conf_dir()


@pytest.mark.parametrize("task", ["residue", "jsonl_math"])
def test_iso_train_runs_anywhere_with_a_clean_stderr(installed: Installed, tmp_path: Path, task: str) -> None:
    workdir, run_dir = tmp_path / "elsewhere", tmp_path / "run"
    workdir.mkdir()
    proc = _run([installed.script("iso-train"), *TINY, f"task={task}", f"out_dir={run_dir}"], cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noisy = [line for line in (proc.stderr + proc.stdout).splitlines() if NOISE.search(line)]
    assert noisy == [], "\n".join(noisy)
    assert (run_dir / "metrics.jsonl").is_file()
    assert sorted(p.name for p in workdir.iterdir()) == [], "iso-train wrote into its working directory"


# Run in the installed copy's Python before anything else: ``triton`` is absent as on a CPU machine without the
# dev extra (``importlib.util.find_spec`` finds nothing, ``import triton`` raises ModuleNotFoundError), while
# the borrowed site-packages still hold it.
NO_TRITON = """
import importlib.machinery as m, sys
class NoTriton:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return m.PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [NoTriton if f is m.PathFinder else f for f in sys.meta_path]
"""


def test_iso_train_runs_without_triton(installed: Installed, tmp_path: Path) -> None:
    """A plain ``pip install .`` (no extras) on a CPU machine has no Triton: the op loader skips the Triton
    modules by name, so no module it loads may import triton (issue 58: ops/gemm/gemm_gluon.py did)."""
    run_dir = tmp_path / "run"
    code = NO_TRITON + (
        "from megatron_iso.cli.train import main\n"
        f"sys.argv = ['iso-train', *{[*TINY, f'out_dir={run_dir}']!r}]\n"
        "code = main()\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "sys.exit(code)\n"
    )
    proc = _run([str(installed.python), "-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").is_file()
