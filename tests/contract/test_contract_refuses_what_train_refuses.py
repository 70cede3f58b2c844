"""iso-contract refuses every config iso-train refuses, with the same error: both read a config through
``settings.check_config`` before anything else, so no contract digest exists for a run that cannot start."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_iso.cli.contract import main as iso_contract
from megatron_iso.cli.exit_codes import EXIT_USAGE
from megatron_iso.errors import UserError
from megatron_iso.rl.run import train
from megatron_iso.settings import contract_for
from megatron_iso.settings.compose import load_config

BAD_CONFIGS = [
    pytest.param(["model.params_dtype=fp16"], r"model\.params_dtype='fp16' is not allowed", id="params_dtype"),
    pytest.param(["parallel.tp=3"], r"parallel\.tp=3 does not divide model\.num_attention_heads=8", id="heads_tp"),
    pytest.param(
        ["model=qwen3_next_80b_a3b", "parallel.tp=4"],
        r"parallel\.tp=4 does not divide model\.num_query_groups=2",
        id="query_groups_tp",
    ),
    pytest.param(
        ["profile=performance", "parallel.tp=2", "model.vocab_size=255"],
        r"parallel\.tp=2 does not divide model\.vocab_size=255",
        id="vocab_tp",
    ),
    pytest.param(
        ["model.vocab_size=250"], r"profile\.leaves=8 does not divide model\.vocab_size=250", id="vocab_leaves"
    ),
    pytest.param(["profile.name=fast"], r"profile\.name='fast' is not allowed; allowed values", id="profile_name"),
    pytest.param(["model=tiny_hybrid", "+model.hf_gdn_layout=x"], r"model\.hf_gdn_layout='x'", id="gdn_layout"),
    pytest.param(["profile.gdn_form=chunk", "model=tiny_hybrid"], r"gdn_form='chunk'.*need device=cuda", id="gdn_form"),
    pytest.param(["parallel.cp=3"], r"^parallel\.cp=3 is not allowed; allowed values: \[1, 2, 4, 8\]$", id="cp"),
    pytest.param(
        ["model=tiny_hybrid", "parallel.cp=2", "parallel.pp=2"],
        r"^parallel\.cp=2 with parallel\.pp=2: a pipelined trainer runs CP 1; allowed values: \[1\]$",
        id="cp_pipeline",
    ),
    # A dense model has no experts for EP to shard (once a ValueError deep in the weight loader, after the contract).
    pytest.param(
        ["parallel.ep=2"],
        r"^parallel\.ep=2 does not apply to a dense model: it has no routed experts \(model\.num_experts is not set\); "
        r"allowed values: \[1\]$",
        id="ep_dense",
    ),
    pytest.param(
        ["parallel.pp=2", "model.tie_word_embeddings=true"],
        r"parallel\.pp=2 needs model\.tie_word_embeddings=false",
        id="pp_tied",
    ),
    pytest.param(["rl.lr=-1"], r"rl\.lr=-1 is not allowed", id="rl_lr"),
    pytest.param(["resume=true"], r"resume=true needs the out_dir", id="resume"),
]


@pytest.mark.parametrize(("overrides", "pattern"), BAD_CONFIGS)
def test_iso_contract_refuses_what_iso_train_refuses(overrides, pattern, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run iso-train wrongly started would write its runs/ here
    cfg = load_config(["device=cpu", *overrides])
    by_train = _raised(train, cfg)  # iso-train's own path; each of these is refused before any world opens
    by_contract = _raised(contract_for, cfg)  # what iso-contract digests
    assert (type(by_contract), str(by_contract)) == (type(by_train), str(by_train))
    assert re.search(pattern, str(by_train)), str(by_train)
    assert not any(Path(tmp_path).iterdir())  # nothing written


def _raised(fn: Callable[[Any], Any], cfg: Any) -> BaseException:
    with pytest.raises(UserError) as info:
        fn(cfg)
    return info.value


def test_iso_contract_cli_exits_2_with_the_message_iso_train_gives(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = str(_raised(train, load_config(["device=cpu", "model.params_dtype=fp16"])))
    assert message == "model.params_dtype='fp16' is not allowed; allowed values: ['bf16', 'fp32']"
    for command in ("digest", "show", "lock"):
        assert iso_contract([command, "device=cpu", "model.params_dtype=fp16"]) == EXIT_USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"iso-contract {command}: error: {message}"]
    assert not any(Path(tmp_path).iterdir())  # no lockfile written
