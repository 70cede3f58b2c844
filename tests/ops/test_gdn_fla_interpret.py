"""The performance profile's GDN rollout through FLA (``ops.gdn.fla_stock``) on the CPU: FLA's chunk and fused
recurrent kernels under TRITON_INTERPRET=1 against the torch native path, outputs and final states
(``gdn_fla_interpret_check.py`` says what runs and why its bound is what fp32 allows), and the registry entry that
names FLA's kernels for the cuda rollout. Skipped where fla-core (the dev extra) or triton is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
if importlib.util.find_spec("fla") is None:
    pytest.skip("fla-core is not installed (the dev extra installs it)", allow_module_level=True)

from megatron_iso.testing.triton_interpret import run_interpreted

SCRIPT = Path(__file__).with_name("gdn_fla_interpret_check.py")


def test_fla_rollout_matches_the_torch_native_path_under_the_interpreter():
    res = run_interpreted(script=SCRIPT, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and "fla rollout ok" in res.stdout, (res.stdout + res.stderr)[-4000:]


def test_the_cuda_entry_names_flas_kernels_and_the_cpu_entry_does_not():
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
