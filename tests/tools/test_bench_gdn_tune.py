"""tools/bench_gdn.py --tune (``megatron_iso.bench.kernels.gdn_setup.apply_tune``): names of the forward's and the
Triton backward's tuning constants land on their module; anything else is refused naming the allowed ones."""

import pytest

from megatron_iso.bench.kernels.gdn_setup import apply_tune

pytest.importorskip("triton")


def test_tune_sets_forward_and_backward_constants_and_names_bad_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_iso.ops.gdn.triton import backward as B
    from megatron_iso.ops.gdn.triton import tuning as G

    monkeypatch.setattr(B, "BWD_KS", B.BWD_KS)  # restored after the test
    monkeypatch.setattr(G, "OUT_BV", G.OUT_BV)
    apply_tune(["BWD_KS=16", "OUT_BV=32"])
    assert (B.BWD_KS, G.OUT_BV) == (16, 32)
    assert not hasattr(G, "BWD_KS")  # a backward name never lands on the forward's module
    with pytest.raises(SystemExit, match=r"expected NAME=INT with NAME one of \[.*'BWD_CHAIN_BV_BF16'"):
        apply_tune(["BWD_TILES=2"])
    with pytest.raises(SystemExit, match="a power of two"):
        apply_tune(["BWD_KS=24"])


def test_tune_register_caps_take_any_ptxas_value_and_refuse_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_iso.ops.gdn.triton import backward as B
    from megatron_iso.ops.gdn.triton import tuning as G

    monkeypatch.setattr(G, "DECODE_MAXNREG", G.DECODE_MAXNREG)
    monkeypatch.setattr(B, "BWD_MAXNREG", B.BWD_MAXNREG)
    monkeypatch.setattr(G, "INTERPRET", False)  # the cap is passed on the GPU only
    apply_tune(["DECODE_MAXNREG=168", "BWD_MAXNREG=200"])  # not powers of two: a cap is any register count
    assert G.DECODE_MAXNREG == 168 and G.maxnreg(G.DECODE_MAXNREG) == {"maxnreg": 168}
    assert B.BWD_MAXNREG == 200 and not hasattr(G, "BWD_MAXNREG")
    assert G.maxnreg(0) == {}
    for bad in ("DECODE_MAXNREG=300", "DECODE_PREP_MAXNREG=8"):
        with pytest.raises(SystemExit, match=r"0 \(none\) or in 24\.\.255"):
            apply_tune([bad])
