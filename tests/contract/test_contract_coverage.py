"""The contract covers what runs: every implementation a real RL step dispatches or registers is in the
contract ``iso-contract`` builds for the same config, and the two tools agree on the digest.

Each side runs in its own process, so what one has imported cannot hide what the other misses: forked from
the test harness's fork server (``megatron_iso.testing.cli_process``, torch and Megatron imported, a fresh
interpreter's 6-8 s saved per side), each side first checks that no implementation is registered yet; the tp=2
run is a real torchrun. The tool side builds the contract as ``iso-contract`` does; the run side trains one GRPO step (rollout prefill
and decode, trainer forward and backward) through ``rl.run.train``, recording every registry lookup made
outside the autograd engine, and reports the implementations registered at its end and the digest it wrote
into its checkpoint. Lookups inside a backward pass are not the contract's: ``with_plain_backward``
differentiates the stock formula (the backward is deterministic, not invariant, and no case of the contract).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_iso.testing.cli_process import run_python

REPO = Path(__file__).resolve().parents[2]
FAST = ["rl.steps=1", "rl.group_size=2", "rl.max_response_length=3", "task.prompts_per_step=2", "logger=none"]

# Both sides start with an empty registry, as in a fresh interpreter: nothing imported before them registers.
_EMPTY_REGISTRY = """
from megatron_iso import registry
assert not registry.registered(), [i.ref for i in registry.registered()]
"""

_TOOL_SIDE = (
    _EMPTY_REGISTRY
    + """
import json, sys
from megatron_iso.settings.compose import load_config
from megatron_iso.settings import contract_for
c = contract_for(load_config(sys.argv[1:]))
entries = c.numerical_policy.composition
print(json.dumps({"refs": sorted({e.impl for e in entries}), "ops": sorted({e.op for e in entries}),
                  "policy": c.identities.numerical_policy}))
"""
)

_RUN_SIDE = (
    _EMPTY_REGISTRY
    + """
import json, os, sys
from pathlib import Path
import torch
from megatron_iso.settings.compose import load_config
from megatron_iso import registry
from megatron_iso.ops.common import dispatch

looked_up = set()
real_lookup = registry.lookup

def recording_lookup(op, device_class, profile):
    impl = real_lookup(op, device_class, profile)
    if torch._C._current_graph_task_id() == -1:  # -1: not inside a backward pass
        looked_up.add(impl.ref)
    return impl

registry.lookup = dispatch.lookup = recording_lookup
from megatron_iso.rl.run import train
cfg = load_config(sys.argv[2:])
train(cfg)
from megatron_iso.settings import resolve
s = resolve(cfg)
registered = registry.registered(device_class=s.device_class, profile=s.profile.name.value)
meta = json.loads(next(Path(sys.argv[1]).glob("checkpoints/step_*/meta.json")).read_text())
if os.environ.get("RANK", "0") == "0":
    print(json.dumps({"looked_up": sorted(looked_up), "registered": sorted(i.ref for i in registered),
                      "policy": meta["numerical_policy"]}))
"""
)


def _last_json(args: list[str], *, torchrun: int = 0) -> dict:
    """The last stdout line of ``python *args`` (forked, see the module doc; under torchrun's ``torchrun``
    ranks if set), as JSON."""
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun), *args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    else:
        proc = run_python(args, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(tmp_path: Path, overrides: list[str], tp: int = 1) -> None:
    tool = _last_json(["-c", _TOOL_SIDE, *overrides])
    run_dir = tmp_path / "run"
    script = tmp_path / "run_side.py"
    script.write_text(_RUN_SIDE)
    run = _last_json([str(script), str(run_dir), *overrides, *FAST, f"out_dir={run_dir}"], torchrun=tp if tp > 1 else 0)
    in_contract = set(tool["refs"])
    assert run["looked_up"], "the recording saw no dispatch: the hook is not where the ops look up"
    assert sorted(set(run["looked_up"]) - in_contract) == []
    assert sorted(set(run["registered"]) - in_contract) == []
    assert {"embedding", "tp_reduce"} <= set(tool["ops"])
    assert run["policy"] == tool["policy"]


@pytest.mark.parametrize("profile", ["correctness", "performance"])
@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe", "tiny_hybrid"])
def test_every_implementation_that_runs_is_in_the_tools_contract(tmp_path, model, profile):
    _check(tmp_path, [f"model={model}", f"profile={profile}", "device=cpu"])


@pytest.mark.slow
def test_a_tp2_run_dispatches_only_what_the_tools_contract_holds(tmp_path):
    _check(tmp_path, ["model=tiny_dense", "profile=correctness", "device=cpu", "parallel.tp=2"], tp=2)
