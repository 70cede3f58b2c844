"""Building our models does not repeat Megatron's per-layer "Unknown MLP type" warning; other warnings of that
logger, and the same warning outside our build, still get through."""

from __future__ import annotations

import logging

import pytest

from megatron_iso.testing.harness import run_on_ranks

TL_LOGGER = "megatron.core.transformer.transformer_layer"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _build_and_log(model: str) -> dict:
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.settings.compose import load_config

    log = logging.getLogger(TL_LOGGER)
    rec = _Records()
    log.addHandler(rec)
    log.setLevel(logging.DEBUG)
    try:
        tc = transformer_config(load_config([f"model={model}"]))
        build_model(tc)
        during = list(rec.messages)
        log.warning("Unknown MLP type: outside our build")
        log.warning("another warning")
    finally:
        log.removeHandler(rec)
    return {"layers": tc.num_layers, "during": during, "after": rec.messages[len(during) :]}


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_hybrid_moe"])
def test_no_unknown_mlp_warning_per_layer(model: str) -> None:
    res = run_on_ranks(_build_and_log, 1, args=(model,))[0]
    assert res["layers"] >= 2
    assert not [m for m in res["during"] if m.startswith("Unknown MLP type")], res["during"]
    assert res["after"] == ["Unknown MLP type: outside our build", "another warning"]
