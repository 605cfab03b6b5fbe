"""Packaging: the wheel installs one package, ``shardscope`` (the folders core/ and tui/ as
``shardscope.core`` and ``shardscope.tui``), with every module and stylesheet (a
non-editable install was missing tui.screens and tui.widgets); installed in a fresh venv it
runs from a folder holding its own ``core/`` and ``tui/``; and in a checkout the tests and
the CLI subprocesses they start run this checkout's code (tests/shim, set by conftest)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel`` builds from a copy of the checkout (the build's build/ and
    egg-info stay out of the tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "tests", "bench", "screenshots", "build", "*.egg-info", "__pycache__",
        ".pytest_cache", ".venv"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp / "dist")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    [whl] = (tmp / "dist").glob("shardscope-*.whl")
    return whl


def test_wheel_holds_every_subpackage_and_stylesheet_under_shardscope(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {"shardscope/" + p.relative_to(ROOT).as_posix() for pkg in ("core", "tui")
              for p in (ROOT / pkg).rglob("*") if p.suffix in (".py", ".tcss")
              and "__pycache__" not in p.parts}
    assert {"shardscope/tui/screens/inspector.py", "shardscope/tui/widgets/param_tree.py",
            "shardscope/tui/app.tcss", "shardscope/core/formats/fsdp.py"} <= wanted
    missing = wanted - names
    assert not missing, (f"not in the wheel: {sorted(missing)} (a new folder must be added "
                         "to [tool.setuptools] packages in pyproject.toml)")
    top = {n.split("/")[0] for n in names if not n.startswith("shardscope-")}
    assert top == {"shardscope"}, top  # no top-level core/ or tui/ any more
    [ep] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(ep).decode()
    assert re.search(r"^shardscope = shardscope\.tui\.cli:entry$", scripts, re.M), scripts


def _shadowing_folder(path: Path) -> Path:
    """A user's project folder holding its own ``core/`` and ``tui/`` packages, whose
    import fails loudly."""
    for name in ("core", "tui"):
        (path / name).mkdir(parents=True)
        (path / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name}/ was imported')\n")
    return path


def test_wheel_in_a_fresh_venv_runs_beside_a_folder_named_core(wheel, tmp_path,
                                                               fixtures_root):
    """The wheel installed (no deps: they come from this venv's site-packages through a
    .pth line, which runs none of its .pth files, so neither the editable install nor the
    checkout is on the path) into a fresh venv; run from a folder holding its own core/ and
    tui/: ``shardscope --help``, ``import shardscope.tui.app`` (its stylesheet beside it),
    ``shardscope inspect`` of a real checkpoint, ``python -m shardscope.tui.cli``."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert (site / "shardscope" / "tui" / "app.tcss").is_file()
    assert not (site / "core").exists() and not (site / "tui").exists()

    cwd = _shadowing_folder(tmp_path / "project")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*cmd):
        return subprocess.run([*map(str, cmd)], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)

    r = run(venv / "bin" / "shardscope", "--help")
    assert r.returncode == 0, r.stderr
    assert "inspect" in r.stdout and "merge" in r.stdout

    # the app starts headless (Textual reads its stylesheet app.tcss from the installed
    # package at startup: a missing one is a StylesheetError) and shows the browser
    r = run(py, "-c", "import asyncio, shardscope.tui.app as a, shardscope.core as c\n"
            "print(a.__file__); print(c.__file__)\n"
            "async def main():\n"
            "    app = a.make_app('.')\n"
            "    async with app.run_test(size=(80, 24)) as pilot:\n"
            "        await pilot.pause(0.3)\n"
            "        print(type(app.screen).__name__)\n"
            "asyncio.run(main())")
    assert r.returncode == 0, r.stderr
    app_file, core_file, screen = r.stdout.split()
    assert Path(app_file).is_relative_to(site) and Path(core_file).is_relative_to(site)
    assert screen == "BrowserScreen"

    r = run(venv / "bin" / "shardscope", "inspect", fixtures_root / "w2-qwen2-f32", "--json")
    assert r.returncode == 0, r.stderr
    assert '"world_size": 2' in r.stdout

    r = run(py, "-m", "shardscope.tui.cli", "inspect", fixtures_root / "w2-qwen2-f32")
    assert r.returncode == 0, r.stderr


def _loaded_sources(stderr: str) -> list[str]:
    """The source files ``python -v`` reports loading (``# x.pyc matches x.py``, ``# code
    object from x``)."""
    return re.findall(r"^# (?:\S+ matches |code object from '?)([^'\s]+)", stderr, re.M)


def test_checkout_code_is_what_the_tests_and_their_subprocesses_run(tmp_path):
    """conftest's shim: this process and ``python -m shardscope.tui.cli`` started from
    another folder (one holding its own core/ and tui/) both run this checkout's files, not
    those of the venv's editable install (which may point at another checkout)."""
    import shardscope.core
    import shardscope.tui.cli

    assert Path(shardscope.core.__file__) == ROOT / "core" / "__init__.py"
    assert Path(shardscope.tui.cli.__file__) == ROOT / "tui" / "cli.py"

    cwd = _shadowing_folder(tmp_path / "project")
    r = subprocess.run([sys.executable, "-v", "-m", "shardscope.tui.cli", "--help"], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    ours = [Path(p) for p in _loaded_sources(r.stderr)
            if re.search(r"/(core|tui)/(\w+/)?(__pycache__/)?\w+\.(cpython-\d+\.)?pyc?$", p)
            and "site-packages" not in p]
    assert any(p.name.startswith("cli.") for p in ours), r.stderr[-2000:]
    assert ours and all(p.is_relative_to(ROOT) for p in ours), [
        p for p in ours if not p.is_relative_to(ROOT)]
