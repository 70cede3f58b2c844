"""iso-convert subcommands through main(argv): exit codes, output, and errors naming the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron_iso.checkpoint import read_hf_weights
from megatron_iso.cli.convert import EXIT_BAD_INPUT, EXIT_DIFFERS, EXIT_OK, main


def torch_equal_bits(x, y) -> bool:
    import torch

    return x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32))


def test_import_export_round_trip(hf_tied, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["import", "--hf", str(hf_tied), "--out", str(ckpt), "--tp", "2", "profile=performance"]) == EXIT_OK
    assert "TP=2" in capsys.readouterr().out
    assert json.loads((ckpt / "iso_checkpoint.json").read_text())["layout"] == {"tp": 2, "ep": 1}
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == EXIT_OK
    a, b = read_hf_weights(hf_tied), read_hf_weights(out)
    assert sorted(a) == sorted(b) and all(torch_equal_bits(a[n], b[n]) for n in a)


def test_compare_prints_one_json_object(hf_untied, capsys):
    assert main(["compare", "--hf", str(hf_untied), "--tokens", "3,1,4,1,5", "--max-rel", "1e-5"]) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 5 and result["within_tolerance"] is True
    assert {"max_abs_diff", "max_rel_diff", "profile"} <= set(result)
    # fp32 logits are close, not bitwise (different summation orders): a zero tolerance fails.
    assert main(["compare", "--hf", str(hf_untied), "--seed", "2", "--length", "8", "--max-rel", "0"]) == EXIT_DIFFERS
    assert json.loads(capsys.readouterr().out)["profile"] == "correctness"


def test_bad_inputs_exit_2_naming_the_problem(hf_untied, tmp_path, capsys):
    bad = tmp_path / "bad_hf"
    bad.mkdir()
    config = json.loads((hf_untied / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    assert main(["import", "--hf", str(bad), "--out", str(tmp_path / "c")]) == EXIT_BAD_INPUT
    assert "attention_bias=True is not supported" in capsys.readouterr().err
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_text"}))
    assert main(["compare", "--hf", str(bad)]) == EXIT_BAD_INPUT
    assert "qwen3_5_text" in capsys.readouterr().err
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe", "mlp_only_layers": [1]}))
    assert main(["import", "--hf", str(bad), "--out", str(tmp_path / "c")]) == EXIT_BAD_INPUT
    assert "mlp_only_layers=[1] is not supported" in capsys.readouterr().err
    assert main(["import", "--hf", str(hf_untied), "--out", str(tmp_path / "c"), "--ep", "2"]) == EXIT_BAD_INPUT
    assert "parallel.ep=2" in capsys.readouterr().err
    (tmp_path / "nothing").mkdir()  # a directory that is no checkpoint (a missing one: "no such directory", below)
    assert main(["export", "--ckpt", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == EXIT_BAD_INPUT
    assert "iso_checkpoint.json" in capsys.readouterr().err
    assert main(["compare", "--hf", str(hf_untied), "--tokens", "999"]) == EXIT_BAD_INPUT


def test_import_ep_and_compare_a_moe_checkpoint(hf_moe, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["import", "--hf", str(hf_moe), "--out", str(ckpt), "--tp", "2", "--ep", "2"]) == EXIT_OK
    assert "TP=2 EP=2" in capsys.readouterr().out
    assert (ckpt / "experts-ep01-of-02.safetensors").is_file()
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == EXIT_OK
    a, b = read_hf_weights(hf_moe), read_hf_weights(out)
    assert sorted(a) == sorted(b) and all(torch_equal_bits(a[n], b[n]) for n in a)
    assert main(["compare", "--hf", str(out), "--tokens", "3,1,4,1,5", "--max-rel", "1e-5"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["within_tolerance"] is True


def test_compare_fails_on_nan_logits_and_prints_valid_json(hf_untied, monkeypatch, capsys):
    from megatron_iso.checkpoint import compare

    real = compare._ours

    def nan_logits(*args, **kwargs):
        logits, info = real(*args, **kwargs)
        logits = logits.clone()
        logits[1, 3] = float("nan")
        return logits, info

    monkeypatch.setattr(compare, "_ours", nan_logits)
    assert main(["compare", "--hf", str(hf_untied), "--tokens", "3,1,4", "--max-rel", "1e-5"]) == EXIT_DIFFERS
    captured = capsys.readouterr()
    result = json.loads(captured.out, parse_constant=lambda name: pytest.fail(f"invalid JSON token {name}"))
    assert result["finite"] is False and result["within_tolerance"] is False and result["max_abs_diff"] == "nan"
    assert "NaN or Inf in the logits" in captured.err
    # Without a tolerance the answer is still no.
    assert main(["compare", "--hf", str(hf_untied), "--tokens", "3,1,4"]) == EXIT_DIFFERS


def _listing(path):
    return sorted((str(p.relative_to(path)), p.read_bytes()) for p in path.rglob("*") if p.is_file())


def test_outputs_that_are_the_source_or_a_run_directory_are_refused_before_writing(hf_tied, tmp_path, capsys):
    ckpt, run, hf = tmp_path / "ckpt", tmp_path / "run", tmp_path / "hf"
    shutil.copytree(hf_tied, hf)
    assert main(["import", "--hf", str(hf), "--out", str(ckpt)]) == EXIT_OK
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    before = {p: _listing(p) for p in (hf, ckpt, run)}
    refusals = [
        (["export", "--ckpt", str(ckpt), "--out", str(run)], f"--out {run} is the training run directory"),
        (
            ["export", "--ckpt", str(ckpt), "--out", str(run / "hf" / "x")],
            f"lies inside the training run directory {run}",
        ),
        (["export", "--ckpt", str(ckpt), "--out", str(ckpt)], f"--out {ckpt} is the source directory itself"),
        (["export", "--ckpt", str(ckpt), "--out", str(ckpt / "hf")], f"lies inside the source {ckpt}"),
        (["import", "--hf", str(hf), "--out", str(hf)], f"--out {hf} is the source directory itself"),
        (["import", "--hf", str(hf), "--out", str(hf / "sub")], f"lies inside the source {hf}"),
        (["import", "--hf", str(hf), "--out", str(run)], f"--out {run} is the training run directory"),
        (["export", "--ckpt", "/nope", "--out", str(tmp_path / "o")], "error: --ckpt: no such directory: /nope"),
        (["import", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "--hf: no such directory"),
    ]
    for argv, message in refusals:
        assert main(argv) == EXIT_BAD_INPUT, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert {p: _listing(p) for p in (hf, ckpt, run)} == before
    assert not (run / "hf").exists() and not (ckpt / "hf").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_exported_files_get_the_mode_the_umask_gives(hf_tied, tmp_path, umask, mode):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    old = os.umask(umask)
    try:
        assert main(["import", "--hf", str(hf_tied), "--out", str(ckpt)]) == EXIT_OK
        assert main(["export", "--ckpt", str(ckpt), "--out", str(out), "--max-shard-size", "100000"]) == EXIT_OK
    finally:
        os.umask(old)
    files = [p for d in (ckpt, out) for p in d.iterdir()]
    assert len(files) > 4 and {oct(p.stat().st_mode & 0o777) for p in files} == {oct(mode)}
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~umask)


def test_a_refused_export_leaves_no_output(hf_tied, tmp_path, monkeypatch, capsys):
    """Refused after the weights are written: no output directory (nor the parents made for it), no temporary;
    an existing output keeps its files byte for byte."""
    import megatron_iso.checkpoint.convert as convert
    from megatron_iso.checkpoint.files import CheckpointFileError

    ckpt, previous = tmp_path / "ckpt", tmp_path / "previous"
    assert main(["import", "--hf", str(hf_tied), "--out", str(ckpt)]) == EXIT_OK
    assert main(["export", "--ckpt", str(ckpt), "--out", str(previous)]) == EXIT_OK
    kept = _listing(previous)
    written = []

    def refuse(src, dst):
        written.extend(p.name for p in dst.iterdir())
        raise CheckpointFileError(f"{src}/tokenizer.json: damaged")

    monkeypatch.setattr(convert, "copy_assets", refuse)
    for out in (tmp_path / "new" / "deep" / "out", previous):
        capsys.readouterr()
        assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == EXIT_BAD_INPUT
        assert "tokenizer.json: damaged" in capsys.readouterr().err
    assert "model.safetensors" in written  # refused midway, after the weights
    assert not (tmp_path / "new").exists() and _listing(previous) == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "previous"]
