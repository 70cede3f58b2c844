from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig

from megatron_iso import registry
from megatron_iso.contract.loader import PLUGIN_ENV

REPO = Path(__file__).resolve().parents[2]
FAKE_OPS = "tests.contract.iso_fake_ops"


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Registry holding only the fakes for the duration of a test; the real registry is restored after."""
    from tests.contract import iso_fake_ops

    saved = dict(registry._REGISTRY)
    registry._REGISTRY.clear()
    iso_fake_ops.register_fakes()
    monkeypatch.delenv(PLUGIN_ENV, raising=False)
    monkeypatch.delenv("ISO_FAKE_PERTURB", raising=False)
    try:
        yield
    finally:
        # A package module imported for the first time inside the window registered its real implementations into
        # the fake registry; it will not import (and register) again, so they must outlive the window.
        imported = {k: v for k, v in registry._REGISTRY.items()
                    if k not in saved and getattr(v.fn, "__module__", "").startswith("megatron_iso.")}  # fmt: skip
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
        registry._REGISTRY.update(imported)


@pytest.fixture
def cfg_for() -> Any:
    """cfg_for(*overrides) -> composed root config, device pinned to cpu unless overridden."""
    from megatron_iso.settings.compose import load_config

    def make(*overrides: str) -> DictConfig:
        base = [] if any(o.startswith("device=") for o in overrides) else ["device=cpu"]
        return load_config([*base, *overrides])

    return make


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    """Run `iso-contract` in a fresh interpreter with only the fake ops loaded."""
    import subprocess

    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop(PLUGIN_ENV, None)
    cmd = [sys.executable, "-m", "megatron_iso.cli.contract", *args]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def contract_of(cfg: Any, impls: Any = None) -> Any:
    """``settings.contract_for`` over the registry as the test left it (the fakes, or what it loaded itself)."""
    from megatron_iso.settings import contract_for

    return contract_for(cfg, impls, load_implementations=False)
