"""The package's shape: imports run down the layers, no import cycle anywhere, no oversized module (in the package
or among the scripts under tools/).

Imports are read from the source with ``ast`` (nothing is imported), including imports inside
functions: a lazy import that points up the layers is still a dependency of the module that holds it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_iso"
TOOLS = PACKAGE.parent / "tools"

# Layers, top to bottom: a module may import its own layer or any layer below it. Two packages of one
# layer may import each other's modules only without forming a cycle (checked below).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("bench",),
    ("testing",),
    ("rl",),
    ("checkpoint", "inference"),
    ("models",),
    ("settings",),
    # The contract reads the registry the layers below fill (the root ``registry`` module) and finds
    # the registering modules by name (``contract/loader.py``), so no op or layer imports it.
    ("contract",),
    ("parallel",),
    ("ops",),
    ("platform", "extras", "errors", "registry", "<root>"),
)
RANK = {name: len(LAYERS) - i for i, names in enumerate(LAYERS) for name in names}

MAX_LINES = 600
# Modules (package or tools/ scripts) allowed past MAX_LINES, each with its reason. Keep this short.
LONG_MODULES: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports; ``from pkg import sub`` counts as an import of ``pkg.sub``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in mods else base)
    return {m for m in found if m in mods and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _family(module: str) -> str:
    """``megatron_iso.ops.gemm.reference`` -> ``megatron_iso.ops.gemm``; other modules: their top package."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "ops":
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_package_has_a_layer(graph) -> None:
    assert {_layer(m) for m in graph} <= set(RANK), sorted({_layer(m) for m in graph} - set(RANK))


def test_no_module_import_cycle(graph) -> None:
    assert _cycles(graph) == []


def test_no_package_or_op_family_cycle(graph) -> None:
    families: dict[str, set[str]] = {}
    for module, deps in graph.items():
        families.setdefault(_family(module), set()).update(_family(d) for d in deps if _family(d) != _family(module))
    assert _cycles(families) == []


def test_imports_run_down_the_layers(graph) -> None:
    upward = sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if RANK[_layer(dep)] > RANK[_layer(module)]
    )
    assert upward == []


def test_ops_never_import_the_contract(graph) -> None:
    """Issue 59's proof item, stated on its own so a reordering of LAYERS cannot drop it."""
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("megatron_iso.ops")
        for d in deps
        if d == "megatron_iso.contract" or d.startswith("megatron_iso.contract.")
    )
    assert bad == []


def test_ops_common_imports_no_op_family(graph) -> None:
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("megatron_iso.ops.common")
        for d in deps
        if d.startswith("megatron_iso.ops.") and not d.startswith("megatron_iso.ops.common")
    )
    assert bad == []


def test_no_module_over_the_size_limit() -> None:
    files = [*PACKAGE.rglob("*.py"), *TOOLS.rglob("*.py")]
    assert any(p.parent == TOOLS for p in files), "tools/ scripts not found: the limit would check nothing there"
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in files}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES and path not in LONG_MODULES}
    assert over == {}
    stale = sorted(path for path in LONG_MODULES if sizes.get(path, 0) <= MAX_LINES)
    assert stale == [], "allow-listed modules that no longer need it"


# Kernel modules keep a short header (what the module holds, the invariant it keeps, a link); design essays live in
# docs/ (GDN.md, KERNELS.md), where they are read and kept up to date as one text.
MAX_OPS_DOCSTRING_LINES = 20


def _long_module_docstrings(paths: list[Path]) -> dict[str, int]:
    lines = {str(p): len((ast.get_docstring(ast.parse(p.read_text()), clean=False) or "").splitlines()) for p in paths}
    return {path: n for path, n in lines.items() if n > MAX_OPS_DOCSTRING_LINES}


def test_ops_module_docstrings_stay_short() -> None:
    """Issue 59: long design essays in kernel modules move to docs/, leaving a short header."""
    over = _long_module_docstrings(sorted((PACKAGE / "ops").rglob("*.py")))
    assert {str(Path(p).relative_to(PACKAGE.parent)): n for p, n in over.items()} == {}


def test_the_docstring_check_finds_a_long_one(tmp_path) -> None:
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text('"""' + "line\n" * MAX_OPS_DOCSTRING_LINES + 'last"""\n')
    short.write_text('"""' + "line\n" * (MAX_OPS_DOCSTRING_LINES - 1) + 'last"""\n')
    assert _long_module_docstrings([long, short]) == {str(long): MAX_OPS_DOCSTRING_LINES + 1}


# Packages that may handle OmegaConf objects: the one reading of the config (settings/) and the Hydra apps (cli/).
# Everything else gets typed settings, or the plain resolved config that settings/ produces.
OMEGACONF_PACKAGES = ("settings", "cli")
OMEGACONF_NAMES = {"OmegaConf", "DictConfig", "ListConfig", "open_dict"}


def _omegaconf_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "omegaconf"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "omegaconf":
            found.append(f"from {node.module}")
        elif isinstance(node, ast.Name) and node.id in OMEGACONF_NAMES:
            found.append(node.id)
    return found


def test_omegaconf_only_in_settings_and_cli() -> None:
    """Issue 59's proof item: no module outside settings/ and cli/ reads the raw Hydra config."""
    bad = {
        str(p.relative_to(PACKAGE.parent)): uses
        for p in PACKAGE.rglob("*.py")
        if _layer(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)) not in OMEGACONF_PACKAGES
        and (uses := _omegaconf_uses(p))
    }
    assert bad == {}


def test_the_omegaconf_check_finds_a_use(tmp_path) -> None:
    planted = tmp_path / "m.py"
    planted.write_text("from omegaconf import OmegaConf\n\ndef f(cfg: 'x') -> None:\n    DictConfig\n")
    assert _omegaconf_uses(planted) == ["from omegaconf", "DictConfig"]


# Module names held by more than one package, each because the modules mean the same thing in their packages
# (the reason says which). Any other repeated name is two concepts under one name: rename one.
SHARED_NAMES = {
    "native": "an op family's stock (non-invariant) implementation",
    "reference": "an op family's CPU reference implementation",
    "autograd": "an op family's trainable forward and its deterministic backward",
    "tiles": "an op family's tile constants",
    "backend": "an op family's backend signatures: the Protocol every implementation of its ops answers",
    "bisect": "cli/bisect.py is the command line of bench/bisect.py",
    "convert": "cli/convert.py is the command line of checkpoint/convert.py",
    "gate": "cli/gate.py is the command line of bench/gate.py",
    "correction": "settings/correction.py is the settings group of rl/correction.py",
    "data": "settings/data.py is the settings group of rl/data.py",
    "moe": "bench/kernels/moe.py benchmarks the kernels of models/moe.py",
    "context": "context parallelism: the layout (parallel/) and the trainer pack cut by it (models/)",
    "run": "a run of its package's job: an RL run (rl/), a benchmark run (bench/)",
    "schema": "the schema of the document its package defines: the contract (contract/), the config (settings/)",
}


def test_no_module_name_means_two_things() -> None:
    """Issue 59's proof item: one name, one meaning; ``config.py`` only as the settings' (none: they are named
    by concern, ``settings/compose.py`` composes the Hydra config)."""
    where: dict[str, list[str]] = {}
    for p in PACKAGE.rglob("*.py"):
        if p.name != "__init__.py":
            where.setdefault(p.stem, []).append(str(p.relative_to(PACKAGE.parent)))
    repeated = {name: sorted(paths) for name, paths in where.items() if len(paths) > 1 and name not in SHARED_NAMES}
    assert repeated == {}
    configs = sorted(path for path in where.get("config", []) if not path.startswith("megatron_iso/settings/"))
    assert configs == []
    stale = sorted(name for name in SHARED_NAMES if len(where.get(name, [])) < 2)
    assert stale == [], "allow-listed names no longer repeated"
