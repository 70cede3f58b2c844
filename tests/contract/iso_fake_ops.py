"""Small fake op implementations for the contract tests, isolated from the real ops.

Registered at import (like a real op module) and by :func:`register_fakes` (idempotent, for
fixtures that clear the registry). ``ISO_FAKE_PERTURB=1`` flips one probe output bit, standing in
for a kernel change that the lockfile must catch in a fresh process.
"""

from __future__ import annotations

import os

import torch

from megatron_iso.registry import DEVICE_CLASSES, PROFILES, OpImpl, register

ATTN_NOTE = "decode kernel reduces keys in the same fixed blocks and tree as prefill; proven by test_attention_parity"


def _gemm_probe() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    a = torch.randn(4, 16, generator=g)
    b = torch.randn(16, 8, generator=g)
    out = a @ b
    if os.environ.get("ISO_FAKE_PERTURB") == "1":
        out = (out.view(torch.int32) ^ 1).view(torch.float32)  # one ulp: what a changed kernel looks like
    return {"trainer_forward": out, "decode": out[:1].clone()}


def _attn_probe() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, generator=g)
    return {"prefill": torch.softmax(q, -1), "decode": torch.softmax(q[:1], -1).to(torch.bfloat16)}


def fakes() -> list[OpImpl]:
    out = []
    for dev in DEVICE_CLASSES:
        for prof in PROFILES:
            out.append(
                OpImpl(
                    op="fake_gemm",
                    impl_id=f"fake_gemm.{prof}",
                    version="1",
                    device_class=dev,
                    profile=prof,
                    fn=torch.matmul,
                    constants={"tile_m": 64, "tile_n": 64, "accumulate_dtype": "fp32", "alpha": 1.0},
                    probe=_gemm_probe,
                )
            )
            out.append(
                OpImpl(
                    op="fake_attention",
                    impl_id=f"fake_attention.{prof}",
                    version="1",
                    device_class=dev,
                    profile=prof,
                    fn=torch.softmax,
                    constants={"kv_block": 64},
                    case_impls={"decode": f"fake_attention_decode.{prof}@1"},
                    equivalence_note=ATTN_NOTE,
                    probe=_attn_probe,
                )
            )
            out.append(
                OpImpl(
                    op="fake_logprob",
                    impl_id=f"fake_logprob.{prof}",
                    version="1",
                    device_class=dev,
                    profile=prof,
                    fn=torch.log_softmax,
                )
            )
    return out


def register_fakes() -> None:
    for impl in fakes():
        register(impl)


register_fakes()
