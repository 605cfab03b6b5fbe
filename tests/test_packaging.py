"""The wheel holds every module and stylesheet of the source tree (a non-editable install
was missing tui.screens and tui.widgets)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from conftest import ROOT


def test_wheel_holds_every_subpackage_and_stylesheet(tmp_path):
    src = tmp_path / "src"  # a copy: the build's build/ and egg-info stay out of the tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "tests", "bench", "screenshots", "build", "*.egg-info", "__pycache__",
        ".pytest_cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    [wheel] = (tmp_path / "dist").glob("shardscope-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {p.relative_to(ROOT).as_posix() for pkg in ("core", "tui")
              for p in (ROOT / pkg).rglob("*") if p.suffix in (".py", ".tcss")
              and "__pycache__" not in p.parts}
    assert {"tui/screens/inspector.py", "tui/widgets/param_tree.py", "tui/app.tcss"} <= wanted
    assert wanted - names == set()
