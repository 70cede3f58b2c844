"""The decode-glue kernels compiled for sm_90 on a CPU machine (tools/kernel_resources.py's ``compiled_launches``:
Triton's code generator and bundled ptxas, through each launch's own binding). The interpreter runs a kernel's
Python; it does not type-check loop-carried values, constexpr branches or the launch's integer specialisations (an
argument equal to 1 becomes a constant), which the GPU compile does. Each wrapper is called as the model calls it:
strided projection slices, a decode step (one row per sequence, one sequence: N specialised to 1), a prefill."""

import os

import pytest

from tests.tools.tool_module import load_tool

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under TRITON_INTERPRET=1", allow_module_level=True)

import torch

kr = load_tool("kernel_resources")


def _compiled(call) -> dict:
    with kr.compiled_launches() as found:
        call()
    return dict(found)


@pytest.mark.parametrize("rows,seqs", [(1, 1), (32, 32), (40, 3)])
def test_conv_compiles_for_decode_and_prefill(rows: int, seqs: int) -> None:
    from megatron_iso.ops.gdn.triton import conv_gates as cg

    wide = torch.randn(rows, 8192 + 4096, dtype=torch.bfloat16)
    x = wide[:, :8192]  # the qkv columns of the input projection
    cu = torch.linspace(0, rows, seqs + 1).round().to(torch.int32)
    state = torch.zeros(seqs + 1, 8192, 3, dtype=torch.bfloat16)
    kw = {"conv_state": state, "slots": torch.arange(seqs), "starts": torch.full((seqs,), 5)}
    found = _compiled(lambda: cg.causal_conv1d(x, torch.randn(8192, 4, dtype=torch.bfloat16), cu, **kw))
    assert found["_conv_kernel"].registers > 0
    # one row per sequence: the conv shifts the state itself, no second launch
    assert ("_conv_state_kernel" in found) == (rows != seqs), sorted(found)


def test_l2norm_gates_and_gated_norm_compile_on_strided_slices() -> None:
    from megatron_iso.ops.gdn.triton import conv_gates as cg
    from megatron_iso.ops.norm.norm_triton import gated_rms_norm_triton

    t = 32
    proj = torch.randn(t, 12352, dtype=torch.bfloat16)
    conv = torch.randn(t, 8192, dtype=torch.bfloat16)

    def calls() -> None:
        cg.l2norm(conv[:, :4096].reshape(t, 32, 128))
        cg.gdn_gates(proj[:, -64:-32], proj[:, -32:], torch.randn(32), torch.randn(32))
        z = proj[:, 8192 : 8192 + 4096].reshape(t, 32, 128)
        gated_rms_norm_triton(torch.randn(t, 32, 128, dtype=torch.bfloat16), z, torch.ones(128, dtype=torch.bfloat16))

    found = _compiled(calls)
    assert {"_l2norm_kernel", "_gates_kernel", "_rms_norm_kernel"} <= set(found), sorted(found)


def test_slot_order_with_sources_compiles() -> None:
    from megatron_iso.ops.moe import slots_triton

    flat = torch.randint(0, 32, (128,))
    out = [torch.empty_like(flat) for _ in range(3)]
    # the launch slot_order_triton makes (its own check wants a CUDA tensor)
    found = _compiled(
        lambda: slots_triton._slot_order_kernel[(1,)](flat, *out, 128, 4, WRITE_SOURCE=True, BLOCK=128, num_warps=4)
    )
    assert found["_slot_order_kernel"].registers > 0


def test_kv_write_compiles_on_qkv_views() -> None:
    from megatron_iso.ops.attention.attention_triton import write_cache

    qkv = torch.randn(64, 32 + 8 + 8, 128, dtype=torch.bfloat16)  # Qwen3-8B heads: the fused projection's views
    kc = torch.zeros(4096, 8, 128, dtype=torch.bfloat16)
    found = _compiled(lambda: write_cache(qkv[:, 32:40], qkv[:, 40:], kc, kc.clone(), [], [], [], dst=torch.arange(64)))
    assert found["_write_kv_kernel"].registers > 0
