"""Ctrl-C (SIGINT) at any moment of a real merge: exit 130, one line, nothing at the output
and no temporary folder. While planning too, where a cold architecture check imports torch
and transformers for seconds: Python runs the signal handler in whatever code is running
there, which may eat the KeyboardInterrupt (``except BaseException``, a finaliser, C code
that clears errors) or raise it inside an ``exec`` of source (dataclasses, namedtuple), which
CPython 3.11's ``python -m`` then turned into death by SIGINT (-2) after exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, copy_checkpoint

STEP = "importing torch and transformers for the architecture check"


def default_sigint():
    """In the child: SIGINT as Python expects it, even when this test runs with SIGINT
    ignored (a background job of a non-interactive shell passes SIG_IGN on)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_at(cmd, line: str, env: dict, cwd=ROOT, timeout: float = 300):
    """Start ``cmd``, send SIGINT as soon as a stderr line contains ``line``; (exit code,
    stderr lines)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    lines = []
    deadline = time.time() + timeout
    for text in proc.stderr:
        lines.append(text.rstrip("\n"))
        if line in text or time.time() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    lines += rest.splitlines()
    return proc.returncode, lines


def assert_nothing_left(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]


def test_ctrl_c_during_the_cold_architecture_check_exits_130(fixtures_root, tmp_path):
    """The real step: `merge -v` with the cache off logs the import of torch and transformers
    and spends seconds in it; Ctrl-C then stops the merge there."""
    out = tmp_path / "out"
    env = dict(os.environ, SHARDSCOPE_CACHE="off")
    code, lines = interrupt_at([sys.executable, "-m", "shardscope.tui.cli", "merge",
                                str(fixtures_root / "w4-fsdp2"), "-o", str(out), "-v"],
                               STEP, env)
    assert STEP in lines, lines
    assert code == 130, lines
    assert lines[-1] == "shardscope: interrupted; nothing was written", lines
    assert "Traceback" not in "\n".join(lines)
    assert_nothing_left(tmp_path, out)


GATE = '''
import sys, time
from shardscope.core import judge
real = judge.tied_aliases
def gated(*a, **k):  # the test's gate: planning waits here for the signal
    print("gate: planning", file=sys.stderr, flush=True)
{body}
    return real(*a, **k)
judge.tied_aliases = gated
from shardscope.tui.cli import entry
entry()
'''

BODIES = {
    # code that eats Ctrl-C: the merge must stop all the same (at the next step)
    "eaten": "    try:\n        time.sleep(60)\n    except BaseException:\n        pass",
    # Ctrl-C inside exec() of source, as while dataclasses are built: `python -m` must still
    # exit 130, not die by SIGINT once main() returned
    "in-exec": "    exec('import time\\ntime.sleep(60)')",
}


@pytest.mark.parametrize("how", sorted(BODIES))
def test_ctrl_c_while_planning_exits_130_however_the_interrupt_lands(fixtures_root, tmp_path,
                                                                      how):
    mod = tmp_path / "gate"
    mod.mkdir()
    (mod / "gated_merge.py").write_text(GATE.format(body=BODIES[how]))
    out = tmp_path / "out"
    env = dict(os.environ, SHARDSCOPE_CACHE="off",
               PYTHONPATH=os.pathsep.join([str(mod), os.environ.get("PYTHONPATH", "")]))
    code, lines = interrupt_at([sys.executable, "-m", "gated_merge", "merge",
                                str(fixtures_root / "w2-qwen2-f32"), "-o", str(out)],
                               "gate: planning", env)
    assert code == 130, lines
    assert lines[-1] == "shardscope: interrupted; nothing was written", lines
    assert_nothing_left(tmp_path, out)


# -- the publishing step (core): rename into place, undone by an interrupt before the commit --


@pytest.fixture
def planned(fixtures_root, tmp_path):
    """A plan of a real merge over an existing output (``--overwrite``), and that output."""
    from shardscope.core import MergeOptions, detect, plan_merge, run_merge

    src = fixtures_root / "w2-qwen2-f32"
    out = tmp_path / "out"
    run_merge(plan_merge(detect(str(src)), MergeOptions(output=str(out))))
    (out / "model.safetensors").write_bytes(b"the output before")  # tell old from new
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    plan = plan_merge(detect(str(src)), MergeOptions(output=str(out), overwrite=True))
    return plan, out, old


def _renames_then(monkeypatch, after: int, act):
    """os.rename as in core/execute.py, but ``act()`` runs right after rename number
    ``after`` (1: the old output moved aside, 2: the new one moved into place)."""
    from shardscope.core import execute

    real, count = execute.os.rename, [0]

    def rename(a, b):
        real(a, b)
        count[0] += 1
        if count[0] == after:
            act()

    monkeypatch.setattr(execute.os, "rename", rename)


@pytest.mark.parametrize("after", [1, 2])
def test_interrupt_while_publishing_puts_the_old_output_back(planned, monkeypatch, after):
    import threading

    from shardscope.core import run_merge

    plan, out, old = planned

    def interrupt():
        raise KeyboardInterrupt

    _renames_then(monkeypatch, after, interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_merge(plan, cancel=threading.Event())
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".out")] == []


def test_cancel_set_while_publishing_puts_the_old_output_back(planned, monkeypatch):
    import threading

    from shardscope.core import MergeCancelled, run_merge

    plan, out, old = planned
    cancel = threading.Event()
    _renames_then(monkeypatch, 2, cancel.set)  # a signal whose KeyboardInterrupt was eaten
    with pytest.raises(MergeCancelled):
        run_merge(plan, cancel=cancel)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".out")] == []


def test_interrupt_after_the_commit_keeps_the_merge_and_says_so(planned, fixtures_root,
                                                                 monkeypatch):
    import shutil
    import threading

    from shardscope.core import execute, run_merge
    from shardscope.core.verify import compare

    plan, out, old = planned
    real, calls = shutil.rmtree, []

    def rmtree(path, *a, **k):  # Ctrl-C while the replaced output is being removed
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(execute.shutil, "rmtree", rmtree)
    cancel = threading.Event()
    try:
        result = run_merge(plan, cancel=cancel)
    except KeyboardInterrupt:
        pytest.fail("an interrupt after the commit undid the merge or escaped run_merge")
    monkeypatch.undo()
    assert cancel.is_set() and result.output == str(out)
    assert compare(str(out), str(fixtures_root / "w2-qwen2-f32.reference"), 0, 0) == []
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".out")] == []


# -- the app: escape while the merge is planning -------------------------------------------


@pytest.mark.asyncio
async def test_escape_while_the_app_plans_a_merge_stops_it_there(fixtures_root, tmp_path,
                                                                 monkeypatch):
    """Escape while the merge run screen is planning (held at the tied-weights check, before
    the architecture check's steps): the merge stops at the next step, run_merge never
    starts, nothing is left; the screen says it was cancelled."""
    import threading

    from conftest import wait_for
    from shardscope.core import judge
    from shardscope.tui.app import make_app
    from shardscope.tui.screens import merge_run
    from test_app import open_form, open_inspector

    gate, entered = threading.Event(), threading.Event()
    real_tied, real_run, ran = judge.tied_aliases, merge_run.run_merge, []

    def gated(*a, **k):  # the test's gate: planning waits here until escape was pressed
        entered.set()
        gate.wait(10)
        return real_tied(*a, **k)

    def run_merge(*a, **k):
        ran.append(True)
        return real_run(*a, **k)

    monkeypatch.setattr(judge, "tied_aliases", gated)
    monkeypatch.setattr(merge_run, "run_merge", run_merge)
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")  # the check's steps run, not the cache's
    out = tmp_path / "out"
    app = make_app(str(fixtures_root / "w3-llama-f32"))
    async with app.run_test(size=(120, 40)) as pilot:
        await open_inspector(pilot, app)
        await open_form(pilot, app, out)
        await pilot.click("#ok")
        await wait_for(pilot, entered.is_set, tries=400)
        run = app.screen
        await pilot.press("escape")
        gate.set()
        await wait_for(pilot, lambda: run.finished, tries=400)
        assert "cancelled; nothing was written" in str(run.query_one("#status").render())
    assert ran == []
    assert_nothing_left(tmp_path, out)


#: a merge over an existing output (--overwrite) whose process dies right after rename
#: number argv[3] of its publishing (1: the old output set aside, 2: the new one in place),
#: as SIGKILL would leave it: nothing runs after (os._exit)
DIES_AFTER_RENAME = r"""
import os, sys
from shardscope.core import MergeOptions, detect, execute, plan_merge, run_merge
plan = plan_merge(detect(sys.argv[1]), MergeOptions(output=sys.argv[2], overwrite=True))
real, count = execute.os.rename, [0]
def rename(a, b):
    real(a, b)
    count[0] += 1
    if count[0] == int(sys.argv[3]):
        os._exit(9)
execute.os.rename = rename
run_merge(plan)
"""


@pytest.mark.parametrize("after", [1, 2])
def test_output_set_aside_by_a_killed_overwrite_merge_is_put_back_or_removed(
        fixtures_root, tmp_path, after):
    """A merge with --overwrite killed between its two renames leaves OUT missing and the old
    output in ``.OUT.shardscope-tmp-old-PID``: the next merge to OUT puts it back (and without
    --overwrite refuses, saying where it came from). Killed after both, the old output is
    superseded: the next merge removes it. Either way no hidden folder is left."""
    from conftest import run_cli

    src = fixtures_root / "w2-qwen2-f32"
    out = tmp_path / "out"
    assert run_cli("merge", str(src), "-o", str(out), "-q").returncode == 0
    (out / "model.safetensors").write_bytes(b"the output before")  # tell old from new
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "shim")}
    r = subprocess.run([sys.executable, "-c", DIES_AFTER_RENAME, str(src), str(out), str(after)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 9, r.stderr
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert any(".shardscope-tmp-old-" in n for n in hidden), hidden
    if after == 1:
        assert not out.exists()
        r = run_cli("merge", str(src), "-o", str(out), "-q")
        assert r.returncode != 0 and "put back from .out.shardscope-tmp-old-" in r.stderr, \
            r.stderr
        assert {p.name: p.read_bytes() for p in out.iterdir()} == old  # as before the kill
    r = run_cli("merge", str(src), "-o", str(out), "--overwrite")
    assert r.returncode == 0, r.stderr
    if after == 2:
        assert "removed " in r.stdout + r.stderr and "interrupted --overwrite" in \
            r.stdout + r.stderr, r.stdout + r.stderr
    assert (out / "model.safetensors").read_bytes() != b"the output before"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
