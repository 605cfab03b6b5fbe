"""core/ never imports textual or rich (nor torch at import time)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import core
import core.formats
from conftest import ROOT

MODULES = ["core"] + [f"core.{m.name}" for m in pkgutil.iter_modules(core.__path__)] + \
    [f"core.formats.{m.name}" for m in pkgutil.iter_modules(core.formats.__path__)]


def test_core_modules_import_no_ui_and_no_torch():
    code = ("import importlib, sys\n"
            f"for m in {MODULES!r}: importlib.import_module(m)\n"
            "bad = [m for m in ('textual', 'rich', 'torch', 'transformers') if m in sys.modules]\n"
            "print(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
