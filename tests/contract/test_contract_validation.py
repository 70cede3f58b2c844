"""Build-time validation: each invalid contract is refused with the field and the allowed values."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_iso import registry
from megatron_iso.contract import ContractValidationError
from megatron_iso.registry import OpImpl
from megatron_iso.settings import SettingsError
from tests.contract.conftest import contract_of

pytestmark = pytest.mark.usefixtures("fake_registry")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["profile.leaves=6"], r"profile\.leaves=6 must be a power of two"),
        (["profile.leaves=0"], r"profile\.leaves=0 must be a power of two"),
        (["profile.leaves=4"], r"profile\.tp_domain contains 8 > profile\.leaves=4"),
        (["profile.tp_domain=[1,3]"], r"tp_domain contains 3, which does not divide profile\.leaves=8"),
        # tp_domain and ep_domain entries go through one check (settings.profile.domain_degrees).
        (["profile.tp_domain=[1,0]"], r"^profile\.tp_domain contains 0; TP degrees are positive integers$"),
        (["profile.ep_domain=[1,0]"], r"^profile\.ep_domain contains 0; EP degrees are positive integers$"),
        (["model=tiny_moe", "profile.ep_domain=[1,two]"], r"^profile\.ep_domain contains 'two'; EP degrees are"),
        (["profile.ep_domain=[1,true]"], r"^profile\.ep_domain contains True; EP degrees are"),
        (
            ["profile.ep_domain=4"],
            r"^profile\.ep_domain=4 is not allowed; allowed values: a list of positive integers$",
        ),
        (["model.ffn_hidden_size=100"], r"profile\.leaves=8 does not divide model\.ffn_hidden_size=100"),
        (["model.vocab_size=250"], r"does not divide model\.vocab_size=250"),
        (["model.num_attention_heads=4", "model.kv_channels=9"], r"model\.num_attention_heads\*model\.kv_channels=36"),
        (
            ["profile.leaves=128", "model.vocab_size=128"],
            r"does not divide model\.hidden_size=64.*\[1, 2, 4, 8, 16, 32, 64\]",
        ),
        (
            ["parallel.tp=16", "model.num_attention_heads=16", "model.num_query_groups=16"],
            r"parallel\.tp=16 is outside profile\.tp_domain=\[1, 2, 4, 8\].*allowed values",
        ),
        (["model=tiny_moe", "model.num_experts=6", "parallel.ep=3"], r"parallel\.ep=3 is outside profile\.ep_domain"),
        (["device=tpu"], r"device='tpu' is not allowed; allowed values: \['cpu', 'cuda', 'auto'\]"),
        (
            ["profile.name=fast"],
            r"profile\.name='fast' is not allowed; allowed values: \['correctness', 'performance'\]",
        ),
        (["profile.expert_leaves=3"], r"profile\.expert_leaves=3 must be a power of two"),
        (
            ["profile.gdn_form=spiral"],
            r"profile\.gdn_form='spiral' is not allowed; allowed values: \['scan', 'chunk', 'auto'\]",
        ),
        (["profile.gdn_form=chunk"], r"profile\.gdn_form='chunk'.*need device=cuda and profile correctness"),
        (
            ["device=cuda", "profile=performance", "+profile.gdn_dot_precision=bf16"],
            r"need device=cuda and profile corr",
        ),
        (
            ["model=tiny_moe", "profile.expert_leaves=64"],
            r"profile\.expert_leaves=64 does not divide model\.moe_ffn_hidden_size=32",
        ),
        (["model=tiny_moe", "model.shared_expert_ffn_hidden_size=36"], r"model\.shared_expert_ffn_hidden_size=36"),
        (["contract.max_batch=0"], r"contract\.max_batch=0 must be a positive integer"),
        (["contract.invalidation=[{state: kv_cache}]"], r"contract\.invalidation\[0\].*keys state, event"),
        (["contract.max_seq_len=4096"], r"contract\.max_seq_len=4096 exceeds model\.max_position_embeddings=512"),
    ],
)
def test_invalid_configs_are_refused(cfg_for, overrides, pattern):
    with pytest.raises(ContractValidationError, match=pattern):
        contract_of(cfg_for(*overrides))


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            ["model=qwen3_next_80b_a3b", "parallel.tp=4"],
            r"parallel\.tp=4 does not divide model\.num_query_groups=2: Megatron cannot shard this model that way; "
            r"allowed values: \[1, 2\]$",
        ),
        (
            ["parallel.tp=16"],
            r"parallel\.tp=16 does not divide model\.num_attention_heads=8, model\.num_query_groups=4: Megatron cannot "
            r"shard this model that way; allowed values: \[1, 2, 4\]$",
        ),
        (
            ["model=tiny_moe", "model.num_experts=12", "parallel.ep=8"],
            r"parallel\.ep=8 does not divide model\.num_experts=12: .*allowed values: \[1, 2, 3, 4, 6, 12\]$",
        ),
        (["parallel.ep=2"], r"parallel\.ep=2 does not apply to a dense model: .*allowed values: \[1\]$"),
        (["profile=performance", "parallel.ep=4"], r"parallel\.ep=4 does not apply to a dense model"),
        # No invariance domain to check it against, still a layout Megatron cannot shard.
        (["profile=performance", "parallel.tp=3"], r"parallel\.tp=3 does not divide model\.num_attention_heads=8"),
        (
            ["profile=performance", "parallel.tp=4", "model.ffn_hidden_size=130"],
            r"parallel\.tp=4 does not divide model\.ffn_hidden_size=130: .*allowed values: \[1, 2\]$",
        ),
    ],
)
def test_unshardable_layouts_are_refused_with_the_settings_error(cfg_for, overrides, pattern):
    """The contract refuses a layout Megatron cannot shard through the settings' one sharding check."""
    with pytest.raises(SettingsError, match=pattern):
        contract_of(cfg_for(*overrides))


def test_performance_profile_accepts_any_shardable_tp_and_pins_it(cfg_for):
    shardable_at_3 = ["model.num_attention_heads=6", "model.num_query_groups=3", "model.ffn_hidden_size=96"]
    c = contract_of(cfg_for("profile=performance", "parallel.tp=3", *shardable_at_3, "model.vocab_size=258"))
    assert c.numerical_policy.claims.axis("tp").value == 3
    assert c.numerical_policy.to_dict()["claims"]["axes"]["tp"]["kind"] == "pinned"


def test_asymmetric_entry_without_note_is_refused(cfg_for):
    old = registry.lookup("fake_attention", "cpu", "correctness")
    registry._REGISTRY[("fake_attention", "cpu", "correctness")] = dataclasses.replace(old, equivalence_note=" ")
    with pytest.raises(
        ContractValidationError, match=r"composition\.fake_attention\.equivalence_note is empty.*decode"
    ):
        contract_of(cfg_for())
    # the performance profile claims no parity, so it records the asymmetry without a note
    perf = registry.lookup("fake_attention", "cpu", "performance")
    registry._REGISTRY[("fake_attention", "cpu", "performance")] = dataclasses.replace(perf, equivalence_note="")
    contract_of(cfg_for("profile=performance"))


def test_impl_constant_must_agree_with_profile(cfg_for):
    with pytest.raises(ContractValidationError, match=r"composition\.fake_gemm\.constants\.accumulate_dtype='fp32'"):
        contract_of(cfg_for("profile.accumulate_dtype=fp64"))


def test_empty_registry_is_refused(cfg_for):
    registry._REGISTRY.clear()
    with pytest.raises(ContractValidationError, match=r"no op implementations registered.*load_op_implementations"):
        contract_of(cfg_for())


def test_impls_for_another_device_are_refused(cfg_for):
    cuda = registry.registered(device_class="cuda", profile="correctness")
    with pytest.raises(ContractValidationError, match="do not match device_class='cpu'"):
        contract_of(cfg_for(), impls=cuda)


def test_case_impls_validated_by_registry():
    with pytest.raises(ValueError, match="not in cases"):
        OpImpl("x", "x.ref", "1", "cpu", "correctness", fn=abs, cases=("prefill",), case_impls={"decode": "y@1"})
    with pytest.raises(ValueError, match="impl_id@version"):
        OpImpl("x", "x.ref", "1", "cpu", "correctness", fn=abs, case_impls={"decode": "y"})


def test_plain_dict_config_works_and_auto_device_resolves(cfg_for):
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg_for("device=auto"), resolve=True)
    c = contract_of(plain)
    assert c.numerical_policy.device_class in ("cpu", "cuda")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ([], r"device=cuda: model\.ffn_hidden_size=128 over 8 leaves gives leaf depth 16.*K tile 32"),
        (
            ["model.params_dtype=bf16", "model.ffn_hidden_size=1024", "model.kv_channels=128", "model.hidden_size=96"],
            r"device=cuda: model\.hidden_size \(column-parallel K\)=96 over 1 leaves.*K tile 64",
        ),
        (["model=tiny_moe", "model.ffn_hidden_size=256", "model.kv_channels=32"], r"shared_expert_ffn_hidden_size=64"),
    ],
)
def test_gpu_gemm_shapes_refused_before_a_cuda_run(cfg_for, overrides, pattern):
    from megatron_iso.settings import check_gpu_gemm_shapes

    with pytest.raises(ContractValidationError, match=pattern):
        check_gpu_gemm_shapes(cfg_for(*overrides))


@pytest.mark.parametrize("model", ["qwen3_0p6b", "qwen3_8b", "qwen3_30b_a3b", "qwen3_next_80b_a3b", "qwen3p5_35b_a3b"])
def test_real_shapes_fit_the_gpu_gemm_tiles(cfg_for, model):
    from megatron_iso.settings import check_gpu_gemm_shapes

    check_gpu_gemm_shapes(cfg_for(f"model={model}"))
    check_gpu_gemm_shapes(cfg_for("profile=performance"))  # no Triton GEMM there: nothing to check


def test_invariance_domain_is_narrowed_to_layouts_the_model_can_run(cfg_for):
    claims = contract_of(cfg_for("model=qwen3_next_80b_a3b")).to_dict()["numerical_policy"]["claims"]["axes"]
    assert claims["tp"]["domain"] == [1, 2]  # 2 KV groups: TP 4 and 8 cannot shard attention
    assert claims["ep"]["domain"] == [1, 2, 4, 8]
    dense = contract_of(cfg_for()).to_dict()["numerical_policy"]["claims"]["axes"]
    assert dense["tp"]["domain"] == [1, 2, 4]  # tiny_dense: 4 KV groups


@pytest.mark.parametrize(
    ("overrides", "ep_domain"),
    [
        ([], [1]),  # tiny_dense: no routed experts, parallel.ep > 1 refused
        (["model=qwen3_0p6b"], [1]),
        (["model=tiny_moe"], [1, 2, 4, 8]),
        (["model=tiny_moe", "model.num_experts=6"], [1, 2]),
    ],
)
def test_contract_claims_only_the_ep_degrees_the_trainer_accepts(cfg_for, overrides, ep_domain):
    """The claimed EP domain is the profile's degrees the layout check accepts, no more: a dense model claims
    EP 1 only, an MoE model the degrees that divide its experts. Every claimed degree passes check_config, every
    profile degree left out is refused by it."""
    from megatron_iso.settings import check_config

    claims = contract_of(cfg_for(*overrides)).to_dict()["numerical_policy"]["claims"]["axes"]
    assert claims["ep"]["domain"] == ep_domain
    for ep in [1, 2, 4, 8]:
        if ep in ep_domain:
            check_config(cfg_for(*overrides, f"parallel.ep={ep}"))
        else:
            with pytest.raises(SettingsError, match=rf"^parallel\.ep={ep} does not"):
                check_config(cfg_for(*overrides, f"parallel.ep={ep}"))


def test_register_refuses_a_constant_the_contract_cannot_record() -> None:
    """A constant of a type the contract cannot canonicalise fails at registration (module import), naming the
    constant, so it cannot first surface when a GPU run builds its contract."""
    bad = OpImpl(
        op="bad_constant_probe", impl_id="bad_constant_probe.test", version="1", device_class="cpu",
        profile="correctness", fn=lambda: None, constants={"block": {"ieee": 16}},
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"constant 'block' has unsupported type dict"):
        registry.register(bad)
    assert all(i.op != "bad_constant_probe" for i in registry.registered())
    ok = dataclasses.replace(bad, constants={"block": [16, 32]})
    assert registry.register(ok).canonical()["constants"] == {"block": [16, 32]}


def test_cp_domain_is_claimed_for_every_model_family(cfg_for):
    """Context parallelism is an invariant claim of the correctness profile for dense, MoE and hybrid (GDN) models;
    the performance profile pins it (its CP 2 is another policy); a pipeline with CP is refused."""
    from megatron_iso.settings import check_config

    def cp_claim(*overrides: str) -> dict:
        return contract_of(cfg_for(*overrides)).to_dict()["numerical_policy"]["claims"]["axes"]["cp"]

    assert cp_claim()["domain"] == [1, 2, 4, 8] and cp_claim()["kind"] == "invariant"
    assert cp_claim("model=tiny_moe", "parallel.cp=4")["domain"] == [1, 2, 4, 8]
    assert cp_claim("model=tiny_hybrid", "parallel.cp=2")["domain"] == [1, 2, 4, 8]
    assert cp_claim("profile=performance") == {"kind": "pinned", "domain": None, "value": 1, "tolerance": None}
    assert cp_claim("profile=performance", "parallel.cp=2")["value"] == 2
    check_config(cfg_for("parallel.cp=8"))
    check_config(cfg_for("model=tiny_hybrid", "parallel.cp=4"))
    with pytest.raises(SettingsError, match=r"^parallel\.cp=2 with parallel\.pp=2: a pipelined trainer runs CP 1"):
        check_config(cfg_for("model=tiny_hybrid", "parallel.cp=2", "parallel.pp=2"))
    with pytest.raises(SettingsError, match=r"^parallel\.cp=6 is not allowed; allowed values: \[1, 2, 4, 8\]$"):
        check_config(cfg_for("parallel.cp=6"))
