"""iso-bisect: per-op digests of two runtime configurations on the same input; the first differing op."""

from __future__ import annotations

import json

from megatron_iso.bench.bisect import bisect, format_result, op_families, parse_side
from megatron_iso.cli.bisect import main


def test_iso_layouts_and_cases_do_not_diverge(capsys):
    # TP=1 vs TP=2 with SP: every replicated output (norms, row-parallel GEMMs, layers) is identical.
    assert main(["--a", "device=cpu", "--b", "device=cpu parallel.tp=2 parallel.sp=true"]) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out
    n = int(out.split("no divergence: ")[1].split(" ops")[0])
    assert n >= 20  # embedding, norms, linear_proj/fc2, layers, final norm of both layers were compared
    # Training forward vs prefill + decode: every op, sharded or not, bitwise identical.
    res = bisect(parse_side("device=cpu"), parse_side("device=cpu case=prefill_decode"))
    assert res.first_divergence is None and not res.skipped
    assert any(r.module.endswith("core_attention") for r in res.compared)


def test_iso_vs_native_names_the_first_differing_op(capsys, tmp_path):
    out_json = tmp_path / "ops.json"
    code = main(
        ["--a", "device=cpu profile=correctness", "--b", "device=cpu profile=performance", "--json", str(out_json)]
    )
    assert code == 1
    out = capsys.readouterr().out
    first = next(r for r in json.loads(out_json.read_text())["ops"] if r["status"] == "differs")
    ops = tuple(first["ops"])
    assert set(ops) & {"rmsnorm", "gemm", "attention", "embedding"}, first
    assert first["max_abs_diff"] > 0 and first["digest_a"] != first["digest_b"]
    # Both sides' implementation ids are named: the invariant reference vs the native path.
    op = ops[0]
    assert "reference" in first["impls_a"][op] and "native" in first["impls_b"][op]
    assert f"first divergence: layer {first['layer']}, op {first['module']}" in out
    assert "implementations A:" in out and "implementations B:" in out


def test_native_trainer_forward_vs_prefill_decode():
    res = bisect(
        parse_side("device=cpu profile=performance"), parse_side("device=cpu profile=performance case=prefill_decode")
    )
    first = res.first_divergence
    assert first is not None, format_result(res)
    before = res.compared[: res.compared.index(first)]
    # The embedding and the first norm see the same rows in any case and agree; the first op to differ
    # is one whose native path depends on how many rows a call holds or on the case: a library GEMM
    # (M-dependent kernel choice) or attention (SDPA over the sequence vs the KV-cache decode path).
    assert any(r.module == "embedding" for r in before) and any(r.module.endswith("input_layernorm") for r in before)
    assert first.layer == 0 and set(first.ops) & {"gemm", "attention"}, format_result(res)
    assert first.max_abs_diff > 0
    print(format_result(res))


def test_bad_side_exits_2(capsys):
    assert main(["--a", "device=cpu case=nope", "--b", "device=cpu"]) == 2
    assert "case='nope' is not allowed" in capsys.readouterr().err
    assert main(["--a", "device=cpu", "--b", "device=cpu", "--prompt-len", "1"]) == 2
    sp_decode = "device=cpu parallel.tp=2 parallel.sp=true case=prefill_decode"
    assert main(["--a", "device=cpu", "--b", sp_decode]) == 2
    assert "the decoder does not run SP" in capsys.readouterr().err
    assert main(["--a", "device=cpu model=tiny_hybrid", "--b", "device=cpu model=tiny_hybrid case=prefill_decode"]) == 2
    assert "case=prefill_decode of a hybrid (GDN) model is not supported yet" in capsys.readouterr().err
    assert main(["--launcher", "mpi", "--a", "device=cpu", "--b", "device=cpu"]) == 2
    assert "--launcher='mpi' is not allowed; allowed values: ['gloo', 'torchrun']" in capsys.readouterr().err


def test_op_families_map_module_names_to_registry_ops():
    assert op_families("decoder.layers.3.self_attention.core_attention") == ("attention",)
    assert op_families("decoder.layers.0.pre_mlp_layernorm") == ("rmsnorm",)
    assert op_families("decoder.final_layernorm") == ("rmsnorm",)
    assert op_families("output_layer") == ("gemm",)
    assert op_families("decoder.layers.1.mlp") == ("gemm", "swiglu")
