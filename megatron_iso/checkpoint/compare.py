"""megatron_iso vs HF transformers on the same checkpoint: fp32 logits, one process, CPU."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_iso.checkpoint.convert import checked_hf_weights, hf_dir_settings
from megatron_iso.checkpoint.hf_config import read_hf_config
from megatron_iso.checkpoint.hf_dir import read_hf_weights


def _ours(hf_dir: Path, overrides: Sequence[str], ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.parallel.world import single_process_world

    # fp32 unless the caller overrides it; TP=1 because the whole vocab's logits are compared here.
    settings = hf_dir_settings(hf_dir, ["model.params_dtype=fp32", *overrides, "parallel.tp=1", "parallel.sp=false"])
    with single_process_world():
        tc = transformer_config(settings)
        weights = checked_hf_weights(read_hf_weights(hf_dir), tc, read_hf_config(hf_dir))
        model = build_model(tc, weights.tensors).eval()
        packed_ids, batch = pack([ids])
        with torch.no_grad():
            logits = model.forward_packed(packed_ids, batch).float()
    return logits, {"profile": settings.profile.name.value, "params_dtype": settings.model.params_dtype}


def _transformers(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, local_files_only=True, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()


def _number(x: torch.Tensor) -> float | str:
    """A float, or its name ("nan", "inf", "-inf") where JSON has no number for it."""
    value = float(x)
    return value if math.isfinite(value) else str(value)


def compare_with_transformers(
    hf_dir: str | Path,
    overrides: Sequence[str] = (),
    tokens: Sequence[int] | None = None,
    seed: int = 0,
    length: int = 16,
) -> dict[str, Any]:
    """Logits of both implementations on ``tokens`` (or ``length`` seeded random ids).

    ``max_rel_diff`` is normwise: max |ours - hf| / max |hf| (elementwise ratios explode at logits
    near zero and say nothing about the model). ``finite`` is False when either side's logits hold a NaN or an
    Inf; the statistics are then written as strings ("nan", "inf"), so the result stays valid JSON."""
    hf_dir = Path(hf_dir)
    vocab = hf_dir_settings(hf_dir).model.vocab_size
    if tokens is None:
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))
    else:
        ids = torch.tensor(list(tokens), dtype=torch.long)
        bad = [t for t in ids.tolist() if not 0 <= t < vocab]
        if bad or ids.numel() == 0:
            raise ValueError(f"tokens must be a non-empty list of ids in [0, {vocab}); got out-of-range {bad[:5]}")
    ours, info = _ours(hf_dir, overrides, ids)
    ref = _transformers(hf_dir, ids)
    diff = (ours - ref).abs()
    logp_diff = (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs()
    return {
        "hf_dir": str(hf_dir),
        **info,
        "tokens": int(ids.numel()),
        "seed": seed if tokens is None else None,
        "finite": bool(torch.isfinite(ours).all() and torch.isfinite(ref).all()),
        "max_abs_diff": _number(diff.max()),
        "max_rel_diff": _number(diff.max() / ref.abs().max()),
        "mean_abs_diff": _number(diff.mean()),
        "max_abs_logprob_diff": _number(logp_diff.max()),
        "argmax_agreement": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
        "bitwise_equal": bool(torch.equal(ours.view(torch.int32), ref.view(torch.int32))),
    }
