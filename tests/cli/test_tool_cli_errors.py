"""iso-gate, iso-bisect, iso-bench and iso-convert against bad input, as a user meets them: exit 2, exactly one
``prog: error:`` line naming the problem, no traceback, and nothing written (the case's working directory stays
empty, so no output file, no half-written checkpoint, no Hydra output directory). Plus the outcome codes that
must stay apart from usage errors: iso-gate's refusals (1, 5) and its failing candidate (6).

Each command line runs as its own process, forked from the test harness's fork server with torch and Megatron
already imported (``megatron_iso.testing.cli_process``), not a fresh interpreter that spends 6-8 s importing them;
:func:`test_the_entry_point_refuses_bad_input_in_one_line` runs one case as a real ``python -m`` process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_iso.testing.cli_process import run_python

# A candidate module for iso-gate (importable from the inputs directory): one that raises, one that moves the
# numbers, one identical but slow. It imports the incumbent under its own name, so the gate's swap leaves it alone.
KERNELS = """
import time

from megatron_iso.ops.norm.reference import rms_norm as _incumbent


def boom(x, w, eps=1e-6, **kwargs):
    raise RuntimeError("kernel exploded")


def different(x, w, eps=1e-6, **kwargs):
    return _incumbent(x, w, eps, **kwargs) * 1.0001


def slow(x, w, eps=1e-6, **kwargs):
    time.sleep(0.05)
    return _incumbent(x, w, eps, **kwargs)
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A tiny HF directory and a checkpoint of it, each also damaged (a truncated weight file, a broken index); a
    garbage lockfile; the candidate module. Shared, read-only: every case runs in its own empty directory."""
    from omegaconf import OmegaConf

    from megatron_iso.checkpoint import import_hf, write_hf_dir
    from megatron_iso.checkpoint.hf_config import hf_config_from_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.settings.compose import load_config

    root = tmp_path_factory.mktemp("inputs")
    cfg = load_config(["model=tiny_dense", "device=cpu"])
    hf = random_hf_state_dict(transformer_config(cfg), seed=1)
    write_hf_dir(root / "hf", hf, hf_config_from_model(OmegaConf.to_container(cfg.model, resolve=True)))
    import_hf(root / "hf", root / "ckpt")
    weights = (root / "hf" / "model.safetensors").read_bytes()
    (root / "hf_truncated").mkdir()
    (root / "hf_bad_index").mkdir()
    for name in ("hf_truncated", "hf_bad_index"):
        (root / name / "config.json").write_bytes((root / "hf" / "config.json").read_bytes())
    (root / "hf_truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (root / "hf_bad_index" / "model.safetensors.index.json").write_text('{"weight_map": ')
    (root / "ckpt_truncated").mkdir()
    for f in (root / "ckpt").iterdir():
        (root / "ckpt_truncated" / f.name).write_bytes(f.read_bytes())
    rank = root / "ckpt_truncated" / "model-tp00-of-01.safetensors"
    rank.write_bytes(rank.read_bytes()[:1000])
    (root / "garbage.lock.json").write_text("{not json")
    (root / "iso_test_kernels.py").write_text(KERNELS)
    return root


GATE = ["-m", "megatron_iso.cli.gate", "--op", "rmsnorm", "--runs", "1", "--warmup", "0", "device=cpu"]
CAND = ["--candidate", "iso_test_kernels:slow"]
BISECT = ["-m", "megatron_iso.cli.bisect", "--json", "{cwd}/ops.json"]
BENCH = ["-m", "megatron_iso.cli.bench", "device=cpu", "bench.out={cwd}/out/bench.json"]
CONVERT = ["-m", "megatron_iso.cli.convert"]

# (id, argv ({inputs}: the shared inputs, {cwd}: the case's own empty directory), the error line's regex)
BAD_INPUT = [
    # iso-gate
    ("gate-min-speedup-abc", [*GATE, *CAND, "--min-speedup", "abc"],
     r"argument --min-speedup: 'abc' is not allowed; allowed values: finite numbers > 0"),
    ("gate-min-speedup-nan", [*GATE, *CAND, "--min-speedup", "nan"], r"--min-speedup: 'nan' is not allowed"),
    ("gate-runs-0", [*GATE, *CAND, "--runs", "0"], r"argument --runs: '0' is not allowed; allowed values: integers >= 1"),
    ("gate-candidate-no-module", [*GATE, "--candidate", "no_such_module:f"], r"cannot import 'no_such_module'"),
    ("gate-unknown-op", [*GATE, *CAND, "--op", "no_such_op"],
     r"no implementation of op 'no_such_op' for device_class='cpu'.*registered ops: \[.*'rmsnorm'"),
    ("gate-garbage-lock", [*GATE, *CAND, "--lock", "{inputs}/garbage.lock.json"],
     r"garbage\.lock\.json: not valid JSON"),
    ("gate-write-lock-without-new-policy", [*GATE, *CAND, "--write-lock", "{cwd}/new.lock.json"],
     r"--write-lock applies to a declared new policy only"),
    ("gate-write-lock-no-dir", [*GATE, *CAND, "--new-policy", "--write-lock", "{cwd}/no/dir/new.lock.json"],
     r"argument --write-lock: '.*/no/dir/new\.lock\.json': directory .*/no/dir does not exist"),
    ("gate-bad-candidate-id", [*GATE, *CAND, "--new-policy", "--candidate-id", "v2"],
     r"candidate_id='v2' is not allowed; allowed values: 'impl_id@version'"),
    # iso-bisect
    ("bisect-tp-3", [*BISECT, "--a", "device=cpu", "--b", "device=cpu parallel.tp=3"],
     r"--b 'device=cpu parallel\.tp=3 case=trainer_forward': parallel\.tp=3 does not divide "
     r"model\.num_attention_heads=8.*allowed values: \[1, 2, 4\]"),
    ("bisect-tp-0", [*BISECT, "--a", "device=cpu parallel.tp=0", "--b", "device=cpu"],
     r"--a .*parallel\.tp=0 is not allowed; allowed values: integers >= 1"),
    ("bisect-bad-case", [*BISECT, "--a", "device=cpu case=decode", "--b", "device=cpu"],
     r"--a 'device=cpu case=decode': case='decode' is not allowed; allowed values: \['trainer_forward', "
     r"'prefill_decode'\]"),
    ("bisect-prompt-len-1", [*BISECT, "--a", "device=cpu", "--b", "device=cpu", "--prompt-len", "1"],
     r"--prompt-len=1 is not allowed; allowed values: integers >= 2"),
    ("bisect-launcher", [*BISECT, "--a", "device=cpu", "--b", "device=cpu", "--launcher", "mpi"],
     r"--launcher='mpi' is not allowed; allowed values: \['gloo', 'torchrun'\]"),
    # iso-bench
    ("bench-tp-3", [*BENCH, "bench.tp=[3]"],
     r"layout correctness/tp3/ep1/sp0 of the grid .*parallel\.tp=3 does not divide model\.num_attention_heads=8.*"
     r"allowed values: \[1, 2, 4\]"),
    ("bench-tp-0", [*BENCH, "bench.tp=[0]"], r"bench\.tp=\[0\] is invalid; allowed: a non-empty list of ints >= 1"),
    ("bench-batch-0", [*BENCH, "bench.batch=[1,0]"], r"bench\.batch=\[1, 0\] is not allowed"),
    ("bench-prompt-len", [*BENCH, "bench.prompt_len=[5,2]"],
     r"bench\.prompt_len=\[5, 2\] is not allowed; allowed values: \[min, max\]"),
    ("bench-temperature", [*BENCH, "bench.temperature=-1"], r"bench\.temperature=-1 is not allowed"),
    ("bench-launcher-flag", [*BENCH, "--launcher", "slurm"],
     r"--launcher='slurm' is not allowed; allowed values: \['gloo', 'torchrun'\]"),
    ("bench-pp-2", [*BENCH, "parallel.pp=2"], r"parallel\.pp=2: .*allowed values: \[1\]"),
    ("bench-device", [*BENCH, "device=tpu"], r"device='tpu' is not allowed; allowed values"),
    # iso-convert
    ("convert-import-truncated", [*CONVERT, "import", "--hf", "{inputs}/hf_truncated", "--out", "{cwd}/ckpt"],
     r"hf_truncated/model\.safetensors: not a readable safetensors file"),
    ("convert-import-bad-index", [*CONVERT, "import", "--hf", "{inputs}/hf_bad_index", "--out", "{cwd}/ckpt"],
     r"hf_bad_index/model\.safetensors\.index\.json: not valid JSON"),
    ("convert-import-tp-0", [*CONVERT, "import", "--hf", "{inputs}/hf", "--out", "{cwd}/ckpt", "--tp", "0"],
     r"argument --tp: '0' is not allowed; allowed values: integers >= 1"),
    ("convert-import-tp-3", [*CONVERT, "import", "--hf", "{inputs}/hf", "--out", "{cwd}/ckpt", "--tp", "3"],
     r"parallel\.tp=3 does not divide model\.num_attention_heads=8.*allowed values: \[1, 2, 4\]"),
    ("convert-import-bad-profile", [*CONVERT, "import", "--hf", "{inputs}/hf", "--out", "{cwd}/ckpt", "profile.leaves=3"],
     r"profile\.leaves=3 must be a power of two"),
    ("convert-export-truncated", [*CONVERT, "export", "--ckpt", "{inputs}/ckpt_truncated", "--out", "{cwd}/hf"],
     r"ckpt_truncated/model-tp00-of-01\.safetensors: not a readable safetensors file"),
    ("convert-compare-tokens", [*CONVERT, "compare", "--hf", "{inputs}/hf", "--tokens", "3,x"],
     r"argument --tokens: '3,x' is not allowed; allowed values: comma-separated integers >= 0"),
    ("convert-compare-max-rel", [*CONVERT, "compare", "--hf", "{inputs}/hf", "--max-rel", "inf"],
     r"argument --max-rel: 'inf' is not allowed; allowed values: finite numbers >= 0"),
]  # fmt: skip


def _run(argv: list[str], inputs: Path, cwd: Path, *, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """``python *argv`` in ``cwd`` with the inputs directory on PYTHONPATH: forked (see the module doc), or in a
    fresh interpreter if ``fresh``."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    args = [a.format(inputs=inputs, cwd=cwd) for a in argv]
    if not fresh:
        return run_python(args, cwd=cwd, env=env, pythonpath=[inputs], timeout=300)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(inputs), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def _prog(argv: list[str]) -> str:
    return "iso-" + argv[1].rsplit(".", 1)[1]


def _tool_lines(stderr: str, prog: str) -> list[str]:
    """The lines the tool wrote in its own name (argparse's and run_cli's: ``iso-x[ sub]: ...``)."""
    return [line for line in stderr.splitlines() if re.match(rf"{prog}( \w+)?: ", line)]


def _check_refused(inputs: Path, tmp_path: Path, argv: list[str], message: str, *, fresh: bool = False) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = _run(argv, inputs, cwd, fresh=fresh)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _tool_lines(proc.stderr, _prog(argv))
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.match(rf"{_prog(argv)}( \w+)?: error: ", lines[0]) and re.search(message, lines[0]), lines[0]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in cwd.rglob("*")) == [], "the tool wrote into its working directory"


@pytest.mark.parametrize(("argv", "message"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_with_exit_2_and_writes_nothing(inputs, tmp_path, argv, message):
    _check_refused(inputs, tmp_path, argv, message)


def test_the_entry_point_refuses_bad_input_in_one_line(inputs, tmp_path):
    # One case end to end through a fresh interpreter: `python -m`, its imports, PYTHONPATH, exit code and stderr.
    (argv, message) = next(c[1:] for c in BAD_INPUT if c[0] == "gate-candidate-no-module")
    _check_refused(inputs, tmp_path, argv, message, fresh=True)


def test_a_candidate_that_raises_is_exit_6_with_its_traceback_not_a_refusal(inputs, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    argv = [*GATE, "--candidate", "iso_test_kernels:boom", "--new-policy", "--write-lock", "{cwd}/new.lock.json"]
    proc = _run(argv, inputs, cwd)
    assert proc.returncode == 6, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and 'raise RuntimeError("kernel exploded")' in proc.stderr
    lines = _tool_lines(proc.stderr, "iso-gate")
    want = "iso-gate: candidate failed: candidate 'iso_test_kernels:boom' raised RuntimeError: kernel exploded"
    assert lines == [want], proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize(
    ("candidate", "code", "verdict"), [("slow", 1, "FAIL (not faster)"), ("different", 5, "FAIL (numerics)")]
)
def test_gate_refusals_have_their_own_codes_apart_from_usage_errors(inputs, tmp_path, candidate, code, verdict):
    # "different" is also slower than nothing: numbers moved wins over speed (5, not 1) whatever the timing.
    proc = _run([*GATE, "--candidate", f"iso_test_kernels:{candidate}"], inputs, tmp_path)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(f"gate: {verdict}")
    assert "Traceback" not in proc.stderr and not _tool_lines(proc.stderr, "iso-gate")
