"""HF safetensors <-> megatron_iso checkpoints against transformers' own files and model:
bitwise round trips through TP layouts, fp32 logits within tolerance, errors naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_iso.checkpoint import export_hf, import_hf, load_checkpoint_hf, load_tokenizer, read_hf_weights
from megatron_iso.checkpoint.compare import compare_with_transformers

# Measured max_rel_diff (max |ours - hf| / max |hf|) on these models is ~1e-6 (fp32): both sides
# compute the same math, but the GEMM leaf tree, attention's key blocks, RMSNorm's mean and RoPE's
# cos/sin sum in another order than ATen's kernels, so the last few bits of fp32 differ.
REL_TOL = 1e-5


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), f"tensor '{name}' differs"


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


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_tied"])
@pytest.mark.parametrize("profile", ["correctness", "performance"])
def test_fp32_logits_match_transformers(request, fixture, profile):
    result = compare_with_transformers(request.getfixturevalue(fixture), [f"profile={profile}"], seed=1, length=24)
    print(f"{fixture} {profile}: {result}")
    assert result["tokens"] == 24 and result["argmax_agreement"] == 1.0
    assert result["max_rel_diff"] < REL_TOL, result
    assert result["max_abs_logprob_diff"] < 1e-4, result


def test_compare_detects_a_wrong_weight(hf_untied, tmp_path):
    """The comparison can fail: swap two layers' MLP weights in the HF files and ours must disagree."""
    bad = tmp_path / "bad"
    shutil.copytree(hf_untied, bad)
    w = load_file(bad / "model.safetensors")
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"
    w[a], w[b] = w[b].clone(), w[a].clone()
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    assert compare_with_transformers(bad, tokens=[5, 7, 11])["max_rel_diff"] < REL_TOL  # both read the same files
    from megatron_iso.checkpoint import compare as cmp_mod

    ids = torch.tensor([5, 7, 11])
    ours, _ = cmp_mod._ours(hf_untied, [], ids)
    assert float((ours - cmp_mod._transformers(bad, ids)).abs().max()) > 1e-3


def _rewrite(hf_dir: Path, dst: Path, edit) -> Path:
    shutil.copytree(hf_dir, dst)
    w = load_file(dst / "model.safetensors")
    edit(w)
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(hf_untied, tmp_path):
    bad = _rewrite(hf_untied, tmp_path / "bad", lambda w: w.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_norm.weight"):
        import_hf(bad, tmp_path / "ckpt")


def test_wrong_shape_is_named(hf_untied, tmp_path):
    def edit(w):
        w["model.layers.0.mlp.gate_proj.weight"] = w["model.layers.0.mlp.gate_proj.weight"][:-1].clone()

    bad = _rewrite(hf_untied, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight.*\[127, 64\].*\[128, 64\]"):
        import_hf(bad, tmp_path / "ckpt")


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
    from megatron_iso.checkpoint import checkpoint_config

    manifest = import_hf(hf_untied, tmp_path / "ckpt", tp=2, overrides=["model.params_dtype=bf16"])
    assert manifest["layout"] == {"tp": 2} and manifest["model"]["params_dtype"] == "bf16"
    assert set(manifest["identities"]) == {"semantic", "numerical_policy", "deployment"}
    cfg = checkpoint_config(tmp_path / "ckpt", ["parallel.tp=4"])
    assert cfg.model.num_query_groups == 4 and cfg.parallel.tp == 4
