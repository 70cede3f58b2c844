"""HF safetensors <-> megatron_iso checkpoints against transformers' own files and model (Qwen3,
Qwen3-MoE, Qwen3-Next): bitwise round trips through TP/EP layouts, fp32 logits within tolerance,
errors naming the tensor."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_iso.checkpoint import export_hf, import_hf, load_checkpoint_hf, load_tokenizer, read_hf_weights
from megatron_iso.checkpoint.compare import compare_with_transformers
from megatron_iso.testing.bits import bits

# Measured max_rel_diff (max |ours - hf| / max |hf|) on these models is 3.5e-7 .. 1.8e-6 (fp32): both
# sides compute the same math, but the GEMM leaf tree, attention's key blocks, RMSNorm's mean, RoPE's
# cos/sin, the MoE combine and GDN's chunked delta rule sum in another order than transformers' torch
# code, so the last few bits of fp32 differ.
REL_TOL = 1e-5
MOE_AND_HYBRID = ["hf_moe", "hf_next", "hf_next_dense"]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), f"tensor '{name}' differs"


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_tied", "hf_sharded", "hf_bf16"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_export_of_import_is_bitwise(request, tmp_path, fixture, tp):
    hf_dir = request.getfixturevalue(fixture)
    manifest = import_hf(hf_dir, tmp_path / "ckpt", tp=tp)
    assert [f["file"] for f in manifest["files"]] == [f"model-tp{r:02d}-of-{tp:02d}.safetensors" for r in range(tp)]
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_tensors(read_hf_weights(hf_dir), read_hf_weights(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )


@pytest.mark.parametrize(
    ("fixture", "tp", "ep"),
    [
        ("hf_moe", 1, 1),
        ("hf_moe", 2, 2),
        ("hf_moe", 4, 4),
        ("hf_next", 1, 1),
        ("hf_next", 2, 2),
        ("hf_next", 4, 2),
        ("hf_next_dense", 2, 1),
    ],
)
def test_moe_and_hybrid_export_of_import_is_bitwise(request, tmp_path, fixture, tp, ep):
    hf_dir = request.getfixturevalue(fixture)
    manifest = import_hf(hf_dir, tmp_path / "ckpt", tp=tp, ep=ep)
    experts = [f"experts-ep{e:02d}-of-{ep:02d}.safetensors" for e in range(ep)] if fixture != "hf_next_dense" else []
    assert [f["file"] for f in manifest["files"]] == [
        *(f"model-tp{r:02d}-of-{tp:02d}.safetensors" for r in range(tp)),
        *experts,
    ]
    assert manifest["layout"] == {"tp": tp, "ep": ep}
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_tensors(read_hf_weights(hf_dir), read_hf_weights(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )


def test_expert_files_hold_each_ep_ranks_experts_once(hf_next, tmp_path):
    import_hf(hf_next, tmp_path / "ckpt", tp=2, ep=2)
    files = {f: load_file(tmp_path / "ckpt" / f) for f in ("model-tp01-of-02.safetensors",)}
    files |= {f"ep{e}": load_file(tmp_path / "ckpt" / f"experts-ep0{e}-of-02.safetensors") for e in (0, 1)}
    hf = read_hf_weights(hf_next)
    tp1, ep1 = files["model-tp01-of-02.safetensors"], files["ep1"]
    # Experts only in the EP files, whole (expert TP = 1): EP rank 1 holds experts 2, 3 as local 0, 1.
    assert not [n for n in tp1 if ".local_experts." in n] and all(".local_experts." in n for n in ep1)
    assert torch.equal(
        ep1["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"],
        hf["model.layers.1.mlp.experts.2.down_proj.weight"],
    )
    assert len(ep1) == len(files["ep0"]) == 2 * 2 * 2  # layers x local experts x (fc1, fc2)
    # Router and shared-expert gate replicated; shared expert TP-split like a dense MLP; GDN heads split.
    assert torch.equal(tp1["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    assert torch.equal(
        tp1["decoder.layers.0.mlp.shared_experts.linear_fc2.weight"],
        hf["model.layers.0.mlp.shared_expert.down_proj.weight"][:, 32:],
    )
    assert torch.equal(tp1["decoder.layers.0.self_attention.A_log"], hf["model.layers.0.linear_attn.A_log"][4:])


def test_moe_relayout_through_a_sharded_hf_dir(hf_next, tmp_path):
    # HF -> (TP 2, EP 2) -> HF (sharded) -> (TP 1, EP 4) -> HF: still the original bits.
    import_hf(hf_next, tmp_path / "a", tp=2, ep=2)
    files = export_hf(tmp_path / "a", tmp_path / "hf_again", max_shard_bytes=60_000)
    assert len(files) > 1
    import_hf(tmp_path / "hf_again", tmp_path / "b", tp=1, ep=4)
    _, full = load_checkpoint_hf(tmp_path / "b")
    assert_same_tensors(read_hf_weights(hf_next), full)


def test_rank_files_hold_megatron_shards(hf_untied, tmp_path):
    import_hf(hf_untied, tmp_path / "ckpt", tp=2)
    r0, r1 = (load_file(tmp_path / "ckpt" / f"model-tp0{r}-of-02.safetensors") for r in (0, 1))
    hf = read_hf_weights(hf_untied)
    assert torch.equal(r1["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"][128:])
    assert torch.equal(r0["decoder.layers.1.mlp.linear_fc2.weight"], hf["model.layers.1.mlp.down_proj.weight"][:, :64])
    assert r0["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        2 * (2 + 1 + 1) * 16,
        64,
    )  # 2 groups x [2 q | k | v] heads


def test_sharded_export_and_tp_relayout(hf_untied, tmp_path):
    import_hf(hf_untied, tmp_path / "tp4", tp=4)
    files = export_hf(tmp_path / "tp4", tmp_path / "hf_again", max_shard_bytes=50_000)
    assert len(files) > 1 and (tmp_path / "hf_again" / "model.safetensors.index.json").is_file()
    # HF dir -> TP=4 -> HF (sharded) -> TP=2 -> HF: still the original bits.
    import_hf(tmp_path / "hf_again", tmp_path / "tp2", tp=2)
    export_hf(tmp_path / "tp2", tmp_path / "final")
    assert_same_tensors(read_hf_weights(hf_untied), read_hf_weights(tmp_path / "final"))
    _, full = load_checkpoint_hf(tmp_path / "tp2")
    assert_same_tensors(read_hf_weights(hf_untied), full)


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_tied", *MOE_AND_HYBRID])
@pytest.mark.parametrize("profile", ["correctness", "performance"])
def test_fp32_logits_match_transformers(request, fixture, profile):
    result = compare_with_transformers(request.getfixturevalue(fixture), [f"profile={profile}"], seed=1, length=24)
    print(f"{fixture} {profile}: {result}")
    assert result["tokens"] == 24 and result["argmax_agreement"] == 1.0
    assert result["max_rel_diff"] < REL_TOL, result
    assert result["max_abs_logprob_diff"] < 1e-4, result


@pytest.mark.parametrize(
    ("fixture", "a", "b"),
    [
        ("hf_untied", "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
        ("hf_moe", "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"),
        ("hf_next", "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias"),
    ],
)
def test_compare_detects_a_wrong_weight(request, tmp_path, fixture, a, b):
    """The comparison can fail: swap two weights in the HF files and ours (on the originals) must disagree."""
    src = request.getfixturevalue(fixture)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    w = load_file(bad / "model.safetensors")
    w[a], w[b] = w[b].clone(), w[a].clone()
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    assert compare_with_transformers(bad, tokens=[5, 7, 11])["max_rel_diff"] < REL_TOL  # both read the same files
    from megatron_iso.checkpoint import compare as cmp_mod

    ids = torch.tensor([5, 7, 11])
    ours, _ = cmp_mod._ours(src, [], ids)
    assert float((ours - cmp_mod._transformers(bad, ids)).abs().max()) > 1e-3


def _rewrite(hf_dir: Path, dst: Path, edit) -> Path:
    shutil.copytree(hf_dir, dst)
    w = load_file(dst / "model.safetensors")
    edit(w)
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("fixture", "name"),
    [
        ("hf_untied", "model.layers.1.self_attn.k_norm.weight"),
        ("hf_moe", "model.layers.1.mlp.experts.3.down_proj.weight"),
        ("hf_moe", "model.layers.0.mlp.gate.weight"),
        ("hf_next", "model.layers.0.linear_attn.dt_bias"),
        ("hf_next", "model.layers.1.mlp.shared_expert_gate.weight"),
    ],
)
def test_missing_tensor_is_named(request, tmp_path, fixture, name):
    bad = _rewrite(request.getfixturevalue(fixture), tmp_path / "bad", lambda w: w.pop(name))
    with pytest.raises(KeyError, match=re.escape(f"'{name}'")):
        import_hf(bad, tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("fixture", "name", "got", "expected"),
    [
        ("hf_untied", "model.layers.0.mlp.gate_proj.weight", [127, 64], [128, 64]),
        ("hf_moe", "model.layers.1.mlp.experts.2.gate_proj.weight", [31, 64], [32, 64]),
        ("hf_next", "model.layers.0.linear_attn.in_proj_qkvz.weight", [383, 64], [384, 64]),
        ("hf_next", "model.layers.0.linear_attn.conv1d.weight", [255, 1, 4], [256, 1, 4]),
    ],
)
def test_wrong_shape_is_named(request, tmp_path, fixture, name, got, expected):
    def edit(w):
        w[name] = w[name][:-1].clone()

    bad = _rewrite(request.getfixturevalue(fixture), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=re.escape(f"'{name}' has shape {got}, expected {expected}")):
        import_hf(bad, tmp_path / "ckpt")


def test_bad_ep_layouts_are_refused_naming_the_field(hf_untied, hf_moe, tmp_path):
    with pytest.raises(ValueError, match=r"parallel.ep=2 .*dense"):
        import_hf(hf_untied, tmp_path / "dense", ep=2)
    with pytest.raises(
        ValueError, match=r"parallel.ep=3 does not divide model.num_experts=4.*allowed values: \[1, 2, 4\]"
    ):
        import_hf(hf_moe, tmp_path / "moe", ep=3)
    assert not (tmp_path / "moe").exists()  # refused before anything was written


def test_unexpected_tensor_is_named(hf_untied, tmp_path):
    bad = _rewrite(
        hf_untied,
        tmp_path / "bad",
        lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": w["model.norm.weight"].clone()}),
    )
    with pytest.raises(KeyError, match="model.layers.0.self_attn.q_proj.bias"):
        import_hf(bad, tmp_path / "ckpt")


def test_sharded_index_pointing_at_a_missing_tensor_is_named(hf_sharded, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf_sharded, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = next(iter(index["weight_map"].values()))
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="model.layers.0.extra.weight"):
        read_hf_weights(bad)


def test_corrupt_expert_file_is_named_on_export(hf_moe, tmp_path):
    import_hf(hf_moe, tmp_path / "ckpt", tp=2, ep=2)
    path = tmp_path / "ckpt" / "experts-ep01-of-02.safetensors"
    w = load_file(path)
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    w[name] = w[name][1:].clone()
    save_file(w, path)
    with pytest.raises(ValueError, match=re.escape(f"experts-ep01-of-02.safetensors: tensor '{name}' has shape")):
        export_hf(tmp_path / "ckpt", tmp_path / "out")


def test_corrupt_rank_file_is_named_on_export(hf_untied, tmp_path):
    import_hf(hf_untied, tmp_path / "ckpt", tp=2)
    path = tmp_path / "ckpt" / "model-tp01-of-02.safetensors"
    w = load_file(path)
    w.pop("decoder.layers.0.self_attention.linear_proj.weight")
    save_file(w, path)
    with pytest.raises(
        KeyError,
        match=r"model-tp01-of-02.safetensors is missing tensor 'decoder.layers.0.self_attention.linear_proj.weight'",
    ):
        export_hf(tmp_path / "ckpt", tmp_path / "out")


def test_tied_model_that_stores_lm_head_round_trips(hf_tied, tmp_path):
    src = _rewrite(
        hf_tied, tmp_path / "src", lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"].clone()})
    )
    manifest = import_hf(src, tmp_path / "ckpt", tp=2)
    assert manifest["hf"]["tied_lm_head_stored"] is True
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_tensors(read_hf_weights(src), read_hf_weights(tmp_path / "out"))
    diverged = _rewrite(
        hf_tied, tmp_path / "div", lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"] + 1})
    )
    with pytest.raises(ValueError, match="lm_head.weight"):
        import_hf(diverged, tmp_path / "ckpt2")


def test_pickled_weights_are_refused(tmp_path):
    from tests.checkpoint.conftest import make_hf_model

    hf = make_hf_model(tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="no pickle"):
        read_hf_weights(hf)


def test_tokenizer_travels_and_loads_locally(hf_untied, tmp_path):
    manifest = import_hf(hf_untied, tmp_path / "ckpt")
    assert "tokenizer.json" in manifest["assets"]
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    text = "hello the policy moved not runtime"
    ids = [load_tokenizer(d)(text)["input_ids"] for d in (hf_untied, tmp_path / "ckpt", tmp_path / "out")]
    assert ids[0] == ids[1] == ids[2] == [2, 4, 5, 6, 7, 8]


def test_manifest_records_layout_and_contract(hf_untied, tmp_path):
    from megatron_iso.checkpoint import checkpoint_settings

    manifest = import_hf(hf_untied, tmp_path / "ckpt", tp=2, overrides=["model.params_dtype=bf16"])
    assert manifest["layout"] == {"tp": 2, "ep": 1} and manifest["model"]["params_dtype"] == "bf16"
    assert set(manifest["identities"]) == {"semantic", "numerical_policy", "deployment"}
    settings = checkpoint_settings(tmp_path / "ckpt", ["parallel.tp=4"])
    assert settings.model.num_query_groups == 4 and settings.parallel.tp == 4
