"""load_op_implementations: every module under the ops package, *_triton skipped without triton."""

from __future__ import annotations

import sys

import pytest

from megatron_iso.contract import loader


@pytest.fixture
def fake_pkg(tmp_path, monkeypatch):
    root = tmp_path / "isofakepkg"
    (root / "fam").mkdir(parents=True)
    (root / "fam_triton").mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("LOADED = True\n")
    (root / "fam" / "__init__.py").write_text("")
    (root / "fam" / "ref.py").write_text("")
    (root / "fam" / "kern_triton.py").write_text("raise ImportError('no triton here')\n")
    (root / "fam_triton" / "__init__.py").write_text("raise ImportError('no triton here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "isofakepkg"
    for name in [m for m in sys.modules if m.startswith("isofakepkg")]:
        del sys.modules[name]


def test_walks_recursively_and_skips_triton_modules(fake_pkg, monkeypatch):
    monkeypatch.setattr(loader, "triton_available", lambda: False)
    monkeypatch.setenv(loader.PLUGIN_ENV, "json, ")
    got = loader.load_op_implementations(packages=[fake_pkg])
    assert got == ["isofakepkg", "isofakepkg.a", "isofakepkg.fam", "isofakepkg.fam.ref", "json"]


def test_triton_modules_are_imported_when_triton_exists(fake_pkg, monkeypatch):
    monkeypatch.setattr(loader, "triton_available", lambda: True)
    with pytest.raises(ImportError, match="no triton here"):
        loader.load_op_implementations(packages=[fake_pkg], extra_modules=[])


def test_broken_op_module_is_an_error_not_a_skip(fake_pkg, tmp_path, monkeypatch):
    (tmp_path / "isofakepkg" / "broken.py").write_text("raise RuntimeError('half written')\n")
    monkeypatch.setattr(loader, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="half written"):
        loader.load_op_implementations(packages=[fake_pkg], extra_modules=[])
