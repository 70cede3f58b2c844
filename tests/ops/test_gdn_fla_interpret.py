"""The performance profile's GDN rollout through FLA (``ops.gdn.fla_stock``) on the CPU: FLA's chunk and fused
recurrent kernels under TRITON_INTERPRET=1 against the torch native path, outputs and final states
(``gdn_fla_interpret_check.py`` says what runs and why its bound is what fp32 allows), and the registry entry that
names FLA's kernels for the cuda rollout.

Both run in child processes that import fla from ``$VENV/fla-site`` (``make venv`` installs fla-core there, or
``ISO_FLA_SITE`` names a directory): where fla imports in the test process itself, transformers' Qwen3-Next and
Qwen3.5 modules bind their GDN functions to FLA's kernels, which cannot run on a CPU, and the HF reference tests
would fail. Skipped where neither that directory nor an installed fla-core is found."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

from megatron_iso.testing.triton_interpret import run_interpreted

FLA_SITE = Path(os.environ.get("ISO_FLA_SITE") or Path(sys.prefix) / "fla-site")
if not (FLA_SITE / "fla").is_dir() and importlib.util.find_spec("fla") is None:
    pytest.skip("fla-core is not installed (make venv puts it in $VENV/fla-site)", allow_module_level=True)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(FLA_SITE), os.environ.get("PYTHONPATH", "")])}

SCRIPT = Path(__file__).with_name("gdn_fla_interpret_check.py")


def test_fla_rollout_matches_the_torch_native_path_under_the_interpreter():
    res = run_interpreted(script=SCRIPT, timeout=300, env=CHILD_ENV)
    assert res.returncode == 0 and "fla rollout ok" in res.stdout, (res.stdout + res.stderr)[-4000:]


REGISTRY_CHECK = textwrap.dedent(
    """
    from megatron_iso.ops.gdn import fla_stock
    from megatron_iso.registry import Profile, lookup

    cuda = lookup("gated_delta_rule", "cuda", Profile.PERFORMANCE)
    version = f"fla-core-{fla_stock.fla_version()}"
    assert cuda.impl_for("prefill") == f"fla.ops.gated_delta_rule.chunk_gated_delta_rule@{version}"
    assert cuda.impl_for("decode") == f"fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule@{version}"
    assert cuda.impl_for("trainer_forward") == cuda.impl_for("trainer_score") == cuda.ref  # the torch chunk code
    assert fla_stock.FLA_CHUNK in cuda.constants["rollout_prefill"]
    assert fla_stock.FLA_RECURRENT in cuda.constants["rollout_decode"]
    cpu = lookup("gated_delta_rule", "cpu", Profile.PERFORMANCE)
    assert {cpu.impl_for(c) for c in cpu.cases} == {cpu.ref}
    assert not any(k.startswith("rollout") for k in cpu.constants)
    print("registry ok")
    """
)


def test_the_cuda_entry_names_flas_kernels_and_the_cpu_entry_does_not():
    res = run_interpreted(REGISTRY_CHECK, timeout=300, env=CHILD_ENV)
    assert res.returncode == 0 and "registry ok" in res.stdout, (res.stdout + res.stderr)[-4000:]
