"""tools/bench_engine_host.py on the tiny model: the engine runs to the end with its forward and draw stubbed, every
request decodes its full length, and the report holds one row per batch with host milliseconds per decode step."""

import importlib.util
import json
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_engine_host", Path(__file__).parents[2] / "tools" / "bench_engine_host.py"
)
tool = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tool
_spec.loader.exec_module(tool)


def test_host_step_times_for_each_batch(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    assert tool.main(["--model", "tiny_dense", "--batch", "1", "3", "--prompt-len", "5", "--new-tokens", "6",
                      "--out", str(out)]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for r in report["rows"]:
        # 6 new tokens: the prefill draws the first, then 5 decode steps (the engine may add a final record step)
        assert r["decode_steps"] >= 5 and 0 < r["decode_step_ms_median"] <= r["decode_step_ms_p90"], r
        assert r["bucket_steps"] == 5, r  # every decode step took the decode-graph path (its host code), none eager
