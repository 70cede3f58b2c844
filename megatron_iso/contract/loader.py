"""Import every module that registers implementations, before a contract is built.

Discovery is by walking the ops package and the parallel package (its tree collectives and vocab
embedding register too), so a new module is in the contract the moment it exists; nobody has to
remember to add it to a list. Packages are named here as strings: the contract layer imports none of
them statically. A module that
fails to import is an error, not a skip: a contract silently missing an op would be a lie.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
from collections.abc import Sequence

DEFAULT_PACKAGES = ("megatron_iso.ops", "megatron_iso.parallel")
# Extra modules (comma separated) to import after the packages: out-of-tree op plugins, test fakes.
PLUGIN_ENV = "ISO_OP_MODULES"
# Modules and packages that need triton: ``*_triton`` and any package named ``triton`` (ops/gdn/triton/).
TRITON_SUFFIX = "_triton"
TRITON_PACKAGE = "triton"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _walk(package: str, skip_triton: bool, out: list[str]) -> None:
    mod = importlib.import_module(package)
    out.append(package)
    path = getattr(mod, "__path__", None)
    if path is None:
        return
    # Own recursion instead of pkgutil.walk_packages: that one imports subpackages before we can
    # decide to skip them, and a *_triton package would fail to import without triton.
    for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
        name = f"{package}.{info.name}"
        if skip_triton and (info.name.endswith(TRITON_SUFFIX) or info.name == TRITON_PACKAGE):
            continue
        if info.ispkg:
            _walk(name, skip_triton, out)
        else:
            importlib.import_module(name)
            out.append(name)


def load_op_implementations(
    packages: Sequence[str] = DEFAULT_PACKAGES, extra_modules: Sequence[str] | None = None
) -> list[str]:
    """Import ``packages`` recursively (skipping the triton modules when triton is absent) and plugins.

    ``extra_modules`` defaults to the comma-separated ``$ISO_OP_MODULES``. Returns the module names
    imported, in order. Importing is idempotent: modules already imported are not re-run.
    """
    skip_triton = not triton_available()
    done: list[str] = []
    for package in packages:
        _walk(package, skip_triton, done)
    if extra_modules is None:
        extra_modules = [m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(",") if m.strip()]
    for name in extra_modules:
        importlib.import_module(name)
        done.append(name)
    return done
