"""Fixtures of the tools' tests: the bench scripts are files under tools/, not package modules."""

import importlib.util
from types import ModuleType

import pytest

from tests.tools.tool_module import TOOLS


@pytest.fixture
def bench_gdn() -> ModuleType:
    """tools/bench_gdn.py, loaded as a module (a fresh one per test)."""
    spec = importlib.util.spec_from_file_location("bench_gdn_under_test", TOOLS / "bench_gdn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
