"""pytest plugin: CPU seconds (this process + its reaped children, ``resource.getrusage``) and
wall seconds of every session/module fixture that takes over half a second (the fixture
writers) and of every test, one JSON line each, so the costs can be compared on a loaded
machine (CPU seconds barely move with load; wall does).

    PYTHONPATH=.ci CITIME_OUT=/tmp/times.jsonl SHARDSCOPE_FIXTURES=/tmp/fresh-cache \\
        python -m pytest -q -p citime tests/test_megatron.py

Fixture lines: ``{"fixture", "wall", "cpu_self", "cpu_children"}``; test lines: ``{"test", ...}``
(setup, call and teardown together). Children are counted once waited for (torch.multiprocessing
joins its ranks; subprocess.run waits)."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


def _cpu() -> tuple[float, float]:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def _write(**row) -> None:
    with open(os.environ.get("CITIME_OUT", "citime.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    s0, c0 = _cpu()
    w0 = time.monotonic()
    yield
    s1, c1 = _cpu()
    wall = time.monotonic() - w0
    if fixturedef.scope in ("session", "module") and wall > 0.5:
        _write(fixture=fixturedef.argname, wall=round(wall, 1), cpu_self=round(s1 - s0, 1),
               cpu_children=round(c1 - c0, 1))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    s0, c0 = _cpu()
    w0 = time.monotonic()
    yield
    s1, c1 = _cpu()
    _write(test=item.nodeid, wall=round(time.monotonic() - w0, 2), cpu_self=round(s1 - s0, 2),
           cpu_children=round(c1 - c0, 2))
