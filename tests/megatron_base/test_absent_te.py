"""Megatron's MoE router on a machine without Transformer Engine (a GPU cluster without TE too)."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from megatron_iso.platform import define_absent_te_kernels

_NAMES = ("te_general_gemm", "fused_permute", "fused_permute_with_probs", "fused_unpermute")


def test_router_gemm_runs_without_te(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("Transformer Engine installed: its kernels are defined")
    for name in _NAMES:
        monkeypatch.delattr(moe_utils, name, raising=False)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(torch.ones(2, 4), torch.ones(3, 4), None, torch.float32)
    define_absent_te_kernels()
    assert all(getattr(moe_utils, name) is None for name in _NAMES)
    out = moe_utils.router_gating_linear(torch.ones(2, 4), torch.ones(3, 4), None, torch.float32)
    assert torch.equal(out, torch.full((2, 3), 4.0))
