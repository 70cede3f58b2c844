"""Smoke test of tools/bench_decode.py on tiny_dense (CPU): every engine generates every token and
the report holds positive rates, the ratios and a decode-step profile."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_decode.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_decode", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_decode_tiny(tmp_path, capsys):
    out = tmp_path / "decode.json"
    argv = ["--model", "tiny_dense", "--batch", "1", "3", "--prompt-len", "5", "--new-tokens", "4"]
    argv += ["--warmup-new-tokens", "1", "--profile-step", "--profile-batch", "3", "--profile-new-tokens", "3"]
    assert _tool().main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == {}
    from megatron_iso.bench.provenance import source_digest

    assert report["source_sha256"] == source_digest()  # the code that ran, wherever its tree came from
    cells = {(c["engine"], c["batch"]): c for c in report["cells"]}
    assert set(cells) == {(e, b) for e in ("iso", "native", "hf") for b in (1, 3)}
    for (engine, batch), c in cells.items():
        assert c["generated"] == batch * 4, (engine, c)  # no early stop in any engine
        assert c["tokens_per_s"] > 0 and c["wall_s"] > 0 and c["note"] == "", (engine, c)
        assert 0 < c["ttft_s"] <= c["wall_s"], (engine, c)
    assert [r["batch"] for r in report["ratios"]] == [1, 3]
    assert all(r["iso/native"] > 0 and r["native/hf"] > 0 for r in report["ratios"])
    profiles = {p["engine"]: p for p in report["profiles"]}
    assert set(profiles) == {"iso", "native", "hf"}
    assert profiles["iso"]["decode_tokens"] == 3 * 2  # 3 new tokens, the first from the prefill step
    parts = {p["name"] for p in profiles["iso"]["parts"]}
    assert {"engine: forward", "engine: draw", "module: decoder.layers.*.mlp"} <= parts, parts
    assert profiles["hf"]["top_cpu_ops"], profiles["hf"]
    printed = capsys.readouterr().out
    assert "| iso/native |" in printed.replace("| batch ", "") and "| hf | 3 | 5 | 4 |" in printed


def test_bench_decode_budget_skips(tmp_path):
    out = tmp_path / "decode.json"
    argv = ["--engines", "native", "--batch", "1", "--prompt-len", "4", "--new-tokens", "2", "--budget-seconds", "1"]
    assert _tool().main([*argv, "--max-seconds", "5", "--out", str(out)]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["note"].startswith("skipped") and cell["tokens_per_s"] is None


def test_step_bytes_counts_the_gdn_state_and_conv_window_per_sequence():
    """The roofline's bytes of a hybrid decode step: one more sequence adds its KV rows of the attention layers and,
    per GDN layer, the fp32 recurrent state and the conv window, each read and written once."""
    from megatron_iso.models.gdn import gdn_layer_indices
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.settings import config_world
    from megatron_iso.settings.compose import load_config

    cfg = load_config(["model=tiny_hybrid"])
    with config_world(cfg):
        model = build_model(transformer_config(cfg))
    mc = model.config
    gdn = len(gdn_layer_indices(mc))
    assert gdn > 0
    elem = model.embedding.word_embeddings.weight.element_size()
    hk, hv, dk, dv = (
        mc.linear_num_key_heads,
        mc.linear_num_value_heads,
        mc.linear_key_head_dim,
        mc.linear_value_head_dim,
    )
    conv = (2 * hk * dk + hv * dv) * (mc.linear_conv_kernel_dim - 1) * elem
    per_seq_gdn = gdn * 2 * (hv * dk * dv * 4 + conv)
    tool = _tool()
    one, two = tool.step_bytes(model, 1, 0), tool.step_bytes(model, 2, 0)
    assert two - one == per_seq_gdn  # context 0: no KV rows; the weights are read once whatever the batch
    kv_token = (mc.num_layers - gdn) * 2 * mc.num_query_groups * mc.kv_channels * elem
    assert tool.step_bytes(model, 1, 10) - one == 10 * kv_token
