"""The scripts under tools/ as modules for their tests (they are files, not package modules)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` loaded as module ``name`` and registered in ``sys.modules`` (a dataclass defined in it
    looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
