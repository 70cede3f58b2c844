"""``model.init_from`` and ``rl.save_hf_every``: a run starts from a small HF checkpoint written by transformers,
trains two steps, writes its policy as an HF directory that transformers loads with the trainer's logits; the run's
own checkpoint starts another run and exports with ``iso-convert export``; a Qwen3-Next config whose layer_types
is no "every k-th layer" pattern imports and matches transformers; a bad path is an error naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_iso.checkpoint.compare import compare_with_transformers
from megatron_iso.checkpoint.hf_config import hf_config_from_model, model_config_from_hf
from megatron_iso.checkpoint.init_from import InitFromError, apply_init_from, build_initial_model, init_assets
from megatron_iso.settings.compose import load_config
from tests.checkpoint.conftest import WORDS, make_hf_model
from tests.checkpoint.test_hf_checkpoint import REL_TOL

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
RUN = ["rl.steps=2", "rl.group_size=2", "task.prompts_per_step=2", "rl.checkpoint_every=1", "device=cpu"]


def _tokenizer_with_chat_template(out: Path) -> None:
    """A word-level tokenizer trained offline (tokenizers), with a chat template and an EOS, plus a generation
    config naming the EOS: what a real checkpoint directory ships."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1], "bos_token_id": 0}))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": 1}))


@pytest.fixture(scope="module")
def hf_start(tmp_path_factory) -> Path:
    out = make_hf_model(tmp_path_factory.mktemp("hf_start"), seed=11)
    _tokenizer_with_chat_template(out)
    return out


@pytest.fixture(scope="module")
def run_from_hf(hf_start, tmp_path_factory) -> Path:
    from megatron_iso.rl.run import train

    run = tmp_path_factory.mktemp("runs") / "from_hf"
    cfg = load_config([f"model.init_from={hf_start}", *RUN, "rl.save_hf_every=2", f"out_dir={run}"])
    out = train(apply_init_from(cfg, overrides=[]))
    assert out["steps_run"] == 2
    return run


def _logits(tc_cfg, init_from: Path) -> torch.Tensor:
    from megatron_iso.models.batch import pack
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.parallel.world import single_process_world

    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    with single_process_world():
        model = build_initial_model(transformer_config(tc_cfg), str(init_from), seed=0).eval()
        packed, batch = pack([ids])
        with torch.no_grad():
            return model.forward_packed(packed, batch).float()


def test_run_takes_model_and_tokenizer_from_the_checkpoint(hf_start, run_from_hf):
    saved = json.loads(sorted((run_from_hf / "checkpoints").glob("step_*/meta.json"))[-1].read_text())
    model = saved["identity"]["model"]
    assert model["init_from"] == str(hf_start.resolve()) and model["name"] == hf_start.name
    assert (model["num_layers"], model["hidden_size"], model["vocab_size"]) == (2, 64, 256)
    assets = init_assets(str(hf_start))
    assert assets.tokenizer_dir == hf_start.resolve() and assets.eos_token_ids == (1,)
    # task.tokenizer null: the checkpoint's tokenizer; one set explicitly stays.
    cfg = load_config([f"model.init_from={hf_start}", "task.tokenizer=null"])
    assert apply_init_from(cfg, overrides=[]).task.tokenizer == str(hf_start.resolve())
    cfg = load_config([f"model.init_from={hf_start}", "task.tokenizer=bytes", "model.params_dtype=bf16"])
    applied = apply_init_from(cfg, overrides=["model.params_dtype=bf16"])
    assert applied.task.tokenizer == "bytes" and applied.model.params_dtype == "bf16"


def test_saved_hf_dir_loads_in_transformers_with_the_trainers_logits(hf_start, run_from_hf):
    from transformers import AutoTokenizer

    hf = run_from_hf / "hf" / "step_000001"
    assert sorted(p.name for p in (run_from_hf / "hf").iterdir()) == ["step_000001"]  # no temporary left
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in hf.iterdir()
    }
    assert AutoTokenizer.from_pretrained(str(hf), local_files_only=True).chat_template == CHAT_TEMPLATE
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == 1  # the start's token ids carried over
    result = compare_with_transformers(hf, length=24)
    assert result["finite"] and result["max_rel_diff"] < REL_TOL, result
    # The exported policy is the trained one (not the start), bit for bit the last run checkpoint's.
    cfg = load_config(["device=cpu"])
    last = run_from_hf / "checkpoints" / "step_000001"
    trained, start = (
        _logits(apply_init_from(_with(cfg, hf), []), hf),
        _logits(apply_init_from(_with(cfg, last), []), last),
    )
    assert torch.equal(trained.view(torch.int32), start.view(torch.int32))
    assert not torch.equal(trained, _logits(apply_init_from(_with(cfg, hf_start), []), hf_start))


def _with(cfg, init_from: Path):
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.model.init_from = str(init_from)
    return cfg


def test_run_checkpoint_starts_a_run_and_exports(run_from_hf, tmp_path):
    from megatron_iso.cli.convert import main
    from megatron_iso.rl.run import train

    ckpt = run_from_hf / "checkpoints" / "step_000001"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert compare_with_transformers(tmp_path / "hf")["max_rel_diff"] < REL_TOL
    exported = (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert exported == (run_from_hf / "hf" / "step_000001" / "model.safetensors").read_bytes()
    # A run directory names its latest checkpoint; the new run records where it started.
    cfg = load_config([f"model.init_from={run_from_hf}", *RUN, "rl.steps=1", f"out_dir={tmp_path / 'next'}"])
    assert train(apply_init_from(cfg, overrides=[]))["steps_run"] == 1
    meta = json.loads((tmp_path / "next" / "checkpoints" / "step_000000" / "meta.json").read_text())
    assert meta["identity"]["model"]["init_from"] == str(ckpt.resolve())


def test_a_garbled_run_checkpoint_is_refused_by_export_and_init_from(run_from_hf, tmp_path, capsys):
    """Export and init_from check every file against its recorded SHA-256 first: refused by name (exit 2 for
    iso-convert), nothing written, the previous checkpoint offered in the command's own terms."""
    import shutil

    from megatron_iso.cli.convert import main

    run = shutil.copytree(run_from_hf, tmp_path / "run")
    ckpt, previous = run / "checkpoints" / "step_000001", run / "checkpoints" / "step_000000"
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    shard.write_bytes(bytes(data))
    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{shard} is not the file saved: expected SHA-256" in err
    assert f"export it instead: iso-convert export --ckpt {previous} --out {out}" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    cfg = apply_init_from(_with(load_config(["device=cpu"]), ckpt), [])
    with pytest.raises(InitFromError, match=rf"{shard} is not the file saved.*model\.init_from={previous}"):
        _logits(cfg, ckpt)


@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_bad_init_from_is_an_error_naming_the_field(tmp_path, kind):
    path = tmp_path / "nowhere"
    if kind == "file":
        path.write_text("x")
    elif kind == "empty":
        path.mkdir()
    with pytest.raises(InitFromError, match=r"model\.init_from=.*(no such directory|is a file|holds no checkpoint)"):
        apply_init_from(load_config([f"model.init_from={path}"]), overrides=[])


def test_bad_init_from_in_iso_train_is_a_usage_error(tmp_path, capsys):
    from megatron_iso.cli.exit_codes import EXIT_USAGE, run_cli
    from megatron_iso.rl.run import train

    cfg = load_config([f"model.init_from={tmp_path / 'nowhere'}", f"out_dir={tmp_path / 'run'}"])
    assert run_cli("iso-train", lambda: train(cfg)) == EXIT_USAGE
    assert "model.init_from=" in capsys.readouterr().err and not (tmp_path / "run").exists()


# Qwen3-Next with three layers whose full-attention layer is first: no "every k-th layer" pattern.
IRREGULAR = ["full_attention", "linear_attention", "linear_attention"]


def test_irregular_qwen3_next_layer_types_import_and_match_transformers(tmp_path):
    import transformers

    from tests.checkpoint import conftest

    kwargs = dict(conftest.TINY_NEXT, num_hidden_layers=3, layer_types=IRREGULAR)
    model = model_config_from_hf(transformers.Qwen3NextConfig(**kwargs).to_dict(), name="irregular")
    assert model["full_attention_interval"] == IRREGULAR
    assert hf_config_from_model(model)["layer_types"] == IRREGULAR
    saved = dict(conftest.FAMILIES)
    conftest.FAMILIES["qwen3_next"] = ("Qwen3NextConfig", "Qwen3NextForCausalLM", kwargs)
    try:
        hf = make_hf_model(tmp_path / "hf", family="qwen3_next", seed=12)
    finally:
        conftest.FAMILIES.clear()
        conftest.FAMILIES.update(saved)
    result = compare_with_transformers(hf, length=20)
    assert result["finite"] and result["max_rel_diff"] < REL_TOL, result


@pytest.mark.parametrize(("fixture", "ep"), [("hf_next", 2), ("hf_qwen3_5_moe_vl", 2), ("hf_tied", 1)])
def test_sliced_reads_give_the_shards_of_the_full_read(request, fixture, ep):
    """Each (TP, EP) rank's shard read by safetensors slices equals the one cut from the whole model: GDN's
    per-head projections and conv channels, a multimodal prefix, experts per EP rank, a stored tied head."""
    from megatron_iso.checkpoint import checked_hf_weights, hf_dir_settings, read_hf_weights
    from megatron_iso.checkpoint.hf_config import read_hf_config
    from megatron_iso.checkpoint.lazy import LazyHFSource
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import megatron_shard

    hf_dir = request.getfixturevalue(fixture)
    tc = transformer_config(hf_dir_settings(hf_dir, ["parallel.tp=2", f"parallel.ep={ep}"]))
    config = read_hf_config(hf_dir)
    full = checked_hf_weights(read_hf_weights(hf_dir), tc, config).tensors
    with LazyHFSource(hf_dir, config, tied=tc.tie_word_embeddings) as lazy:
        for t in range(2):
            lazy.check_tied_head(t, 2)
            for e in range(ep):
                want, got = megatron_shard(full, tc, t, 2, e, ep), megatron_shard(lazy, tc, t, 2, e, ep)
                assert want.keys() == got.keys()
                assert all(torch.equal(want[k], got[k]) for k in want), (t, e)
