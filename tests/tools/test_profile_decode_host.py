"""tools/profile_decode.py --host-only on the tiny model: the engine runs to the end with its forward and draw
stubbed, every decode step is served from the bucket buffers (the decode-graph host code), and the line reports
host milliseconds per decode step."""

import re

from tests.tools.tool_module import load_tool

tool = load_tool("profile_decode")


def test_host_only_times_the_engine_without_its_forward(capsys) -> None:
    args = ["--host-only", "--model", "tiny_dense", "--prompts", "3", "--group", "1", "--prompt-len", "5"]
    assert tool.main([*args, "--new-tokens", "6"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.search(r"host ([0-9.]+) ms per decode step .*p90 ([0-9.]+)\); (\d+) steps from the bucket buffers", line)
    assert found, line
    median, p90, served = float(found[1]), float(found[2]), int(found[3])
    # 6 new tokens: the prefill draws the first, 5 decode steps follow, each from the bucket buffers
    assert 0 < median <= p90 and served == 5, line
