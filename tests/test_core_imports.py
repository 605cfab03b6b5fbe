"""shardscope.core never imports textual or rich (nor torch at import time); no module of the
project imports a top-level ``core`` or ``tui`` (installed, only ``shardscope.core`` and
``shardscope.tui`` exist)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

from shardscope import core, tui
from shardscope.core import formats

MODULES = ["shardscope.core"] + [
    f"shardscope.core.{m.name}" for m in pkgutil.iter_modules(core.__path__)] + [
    f"shardscope.core.formats.{m.name}" for m in pkgutil.iter_modules(formats.__path__)]
UI = ["shardscope.tui"] + [m.name for m in pkgutil.walk_packages(tui.__path__,
                                                                  "shardscope.tui.")]


def _imported(modules: list[str], cwd) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Import ``modules`` in a fresh interpreter (this checkout's shardscope: conftest's
    PYTHONPATH); return the run and the top-level names it then holds among textual, rich,
    torch, transformers, core, tui."""
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = [m for m in ('textual', 'rich', 'torch', 'transformers', 'core', 'tui') "
            "if m in sys.modules]\n"
            "print(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)
    return r, [x for x in r.stdout.strip().split(",") if x]


def test_core_modules_import_no_ui_and_no_torch(tmp_path):
    assert "shardscope.core.formats.fsdp" in MODULES and "shardscope.core.plan" in MODULES
    r, bad = _imported(MODULES, tmp_path)
    assert r.returncode == 0, r.stderr
    assert bad == []


def test_no_module_imports_a_top_level_core_or_tui(tmp_path):
    """Every module of shardscope.tui (which imports shardscope.core's) imported in a folder
    holding no core/ or tui/: none reaches for a top-level `core` or `tui`."""
    assert "shardscope.tui.screens.inspector" in UI and "shardscope.tui.cli" in UI
    r, bad = _imported(MODULES + UI, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "core" not in bad and "tui" not in bad, bad
