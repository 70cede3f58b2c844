"""tools/op_sites.py on tiny_moe (CPU): the rollout phase's ops are counted per package source line, the MoE
router's lines among them, and the JSON holds every (site, op) count."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "op_sites.py"


def test_op_sites_counts_the_rollout_by_source_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("op_sites", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = tmp_path / "sites.json"
    assert module.main(["--model", "tiny_moe", "--new-tokens", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["per"] == 3 and doc["rows"]
    assert all(r["count"] > 0 and r["op"] not in module.NO_KERNEL for r in doc["rows"])
    assert any(r["site"].startswith("models/moe.py:") for r in doc["rows"])
    assert "ATen ops per generated token (tiny_moe, rollout)" in capsys.readouterr().out
