"""megatron_iso.settings: the composed config read once into typed, resolved settings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatron_iso.contract import ContractValidationError
from megatron_iso.registry import PROFILES, Profile
from megatron_iso.settings import ParallelSettings, RLSettings, resolve
from megatron_iso.settings.compose import conf_dir, load_config

REPO = Path(__file__).resolve().parents[1]


def test_profile_enum_is_its_string():
    assert PROFILES == ("correctness", "performance")
    assert Profile.CORRECTNESS == "correctness" and f"{Profile.PERFORMANCE}" == "performance"
    assert str(Profile.CORRECTNESS) == "correctness" and hash(Profile.CORRECTNESS) == hash("correctness")


@pytest.mark.parametrize(
    ("overrides", "device_class", "form"),
    [
        (["device=cpu"], "cpu", "scan"),
        (["device=cuda"], "cuda", "chunk"),  # auto: the GPU kernels' fastest form
        (["device=cuda", "profile.gdn_form=scan"], "cuda", "scan"),
        (["device=cuda", "profile=performance"], "cuda", "scan"),
    ],
)
def test_device_and_gdn_form_resolve(overrides, device_class, form):
    s = resolve(load_config(["model=tiny_hybrid", *overrides]))
    assert (s.device_class, s.profile.gdn_form) == (device_class, form)
    assert s.contract.device_class == device_class
    assert s.contract.profile.get("gdn_form", form) == form  # the contract pins the resolved form, never auto


def test_auto_device_resolves_to_a_device_class():
    assert resolve(load_config(["device=auto"])).device_class in ("cpu", "cuda")


def test_typed_groups_and_leaves():
    s = resolve(load_config(["device=cpu", "rl.lr=0.5", "rl.steps=3"]))
    assert s.profile.name is Profile.CORRECTNESS and s.profile.leaves == 8
    assert s.rl is not None and (s.rl.lr, s.rl.steps) == (0.5, 3) and isinstance(s.rl.lr, float)
    assert s.parallel == ParallelSettings()
    perf = resolve(load_config(["device=cpu", "profile=performance"]))
    assert (perf.profile.leaves, perf.profile.expert_leaves, perf.profile.attention_kv_block) == (1, 1, 64)


def test_bare_groups_resolve_without_rl():
    cfg = load_config(["device=cpu"])
    s = resolve({"model": cfg.model, "profile": cfg.profile, "parallel": cfg.parallel, "device": "cpu"})
    assert s.rl is None and s.gdn_backward_states == "keep"
    with pytest.raises(ContractValidationError, match="config has no 'rl' group"):
        s.require("rl")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["device=tpu"], r"device='tpu' is not allowed; allowed values: \['cpu', 'cuda', 'auto'\]"),
        (
            ["profile.name=fast"],
            r"profile\.name='fast' is not allowed; allowed values: \['correctness', 'performance'\]",
        ),
        (["profile.gdn_form=spiral"], r"profile\.gdn_form='spiral' is not allowed; allowed values: \['scan', 'chunk'"),
        (["model.params_dtype=fp16"], r"model\.params_dtype='fp16' is not allowed; allowed values: \['bf16', 'fp32'\]"),
        (["+model.hf_gdn_layout=x"], r"model\.hf_gdn_layout='x' is not allowed; allowed values: \['qkvz', 'split'\]"),
        (["rl.gdn_backward_states=all"], r"rl\.gdn_backward_states='all' is not allowed; allowed values: \['keep'"),
        (["rl.train_micro_batch_seqs=-1"], r"rl\.train_micro_batch_seqs=-1 is not allowed; allowed values: 0 or null"),
    ],
)
def test_field_errors_name_field_and_allowed_values(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve(load_config(["model=tiny_hybrid", *overrides]))


def test_contract_inputs_refuse_a_gdn_choice_that_does_not_run_here():
    """A model config may carry the chunk form on the CPU (its op refuses to run); the contract refuses it."""
    from megatron_iso.settings import contract_for, contract_inputs

    cfg = load_config(["model=tiny_hybrid", "device=cpu", "profile.gdn_form=chunk"])
    assert resolve(cfg).profile.gdn_form == "chunk"
    for check, arg in ((contract_inputs, cfg), (contract_for, resolve(cfg))):
        with pytest.raises(
            ContractValidationError, match=r"gdn_form='chunk'.*need device=cuda and profile correctness"
        ):
            check(arg)


@pytest.mark.parametrize(
    "overrides",
    [
        ["device=cpu"],
        ["model=tiny_hybrid", "device=cuda", "parallel.tp=2"],
        ["model=tiny_hybrid_moe", "device=cuda", "profile=performance"],
    ],
)
def test_raw_config_and_its_settings_give_one_contract(overrides):
    """iso-contract reads a raw config, iso-train its settings: the same inputs and the same digests."""
    from megatron_iso.settings import contract_for, contract_inputs

    cfg = load_config(overrides)
    assert contract_inputs(cfg) == contract_inputs(resolve(cfg))
    assert contract_for(cfg).identities.to_dict() == contract_for(resolve(cfg)).identities.to_dict()


@pytest.mark.parametrize(("group", "schema"), [("rl", RLSettings), ("parallel", ParallelSettings)])
def test_conf_groups_fit_their_schema(group, schema):
    """Every YAML option of the group merges onto its structured schema (keys and types), and the schema's
    defaults are the default option's values."""
    for path in sorted((conf_dir() / group).glob("*.yaml")):
        cfg = load_config([f"{group}={path.stem}"])
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg[group])
        assert set(merged) == set(cfg[group]), path
    default = load_config([])[group]
    assert OmegaConf.to_container(OmegaConf.structured(schema)) == OmegaConf.to_container(default)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_contract_imports_neither_ops_nor_settings():
    for path in (REPO / "megatron_iso" / "contract").glob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(("megatron_iso.ops", "megatron_iso.settings"))}
        assert not bad, f"{path.name} imports {bad}"
    model_config = _imports(REPO / "megatron_iso" / "models" / "transformer_config.py")
    assert not {n for n in model_config if n.startswith("megatron_iso.contract.build")}


def test_schema_keys_come_from_the_conf_tree(tmp_path, monkeypatch):
    """A key a YAML option adds is known without a code change (another group's additions, e.g.
    rl.future_group.*), and a near miss of it is refused with its name."""
    import shutil

    from megatron_iso.settings import SettingsError, check_overrides

    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    with (conf / "rl" / "grpo.yaml").open("a") as f:
        f.write("future_group:\n  mode: null\n  cap: 2.0\n")
    monkeypatch.setenv("MEGATRON_ISO_CONF", str(conf))
    check_overrides(["rl.future_group.cap=3.0", "+rl.future_group.mode=tis"])
    with pytest.raises(
        SettingsError, match=r"unknown key rl\.future_group\.capp=3; did you mean rl\.future_group\.cap\?"
    ):
        check_overrides(["rl.future_group.capp=3"])
    cfg = load_config(["rl.future_group.cap=abc"])
    with pytest.raises(SettingsError, match=r"rl\.future_group\.cap='abc' is not allowed; allowed values: numbers"):
        resolve(cfg)


def test_help_is_a_description_not_the_config():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "megatron_iso.cli.train", "--help"], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    for needle in ("iso-train: reinforcement learning", "Common overrides", "Exit codes: 0", "docs/", "model: "):
        assert needle in proc.stdout, proc.stdout
    assert "== Config ==" not in proc.stdout and "max_position_embeddings" not in proc.stdout
