"""tools/bench_gdn.py's per-variant summary: the first row of each case (decode: the first --decode batch), and the
exit status follows the mismatch row's bitwise flag."""

import math

import pytest


def _mismatch(bitwise: bool) -> dict:
    return {
        "case": "mismatch",
        "dot_precision": "chunk:bf16",
        "ours_vs_fp64": {"max_abs": 3e-4, "mean_abs": 7e-6},
        "ours_train_vs_rollout": {"max_abs": 0.0 if bitwise else 1e-7, "bitwise_equal": bitwise},
    }


@pytest.mark.parametrize("bitwise", [True, False])
def test_summary_reads_the_first_decode_batch_and_the_bits(
    bench_gdn, bitwise: bool, capsys: pytest.CaptureFixture
) -> None:
    rows = [
        {"case": "train", "dot_precision": "chunk:bf16", "ours_fwd_ms": 2.5},
        {"case": "decode", "batch": 64, "dot_precision": "chunk:bf16", "ours_ms": 0.16},
        {"case": "decode", "batch": 256, "dot_precision": "chunk:bf16", "ours_ms": 0.61},
        _mismatch(bitwise),
    ]
    ok = bench_gdn._variant_summary({"dot_precisions": ["chunk:bf16"], "rows": rows})
    line = capsys.readouterr().out.splitlines()[-1]
    assert ok is bitwise
    cells = [c.strip() for c in line.split("|")]
    assert cells[0] == "chunk:bf16" and float(cells[1]) == 2.5 and math.isnan(float(cells[2]))
    assert float(cells[3]) == 0.16  # batch 64, the first --decode batch, not the last row
    assert cells[-1].endswith(str(bitwise))


def test_summary_without_a_mismatch_row_fails(bench_gdn) -> None:
    assert not bench_gdn._variant_summary({"dot_precisions": ["ieee"], "rows": []})
