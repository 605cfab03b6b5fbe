"""Progress of the steps before a merge writes anything (reading the layout, planning), for
front ends: on a loaded machine reading many rank files or importing torch and transformers
for the architecture check takes tens of seconds, and a silent wait looks like a hang.

``with reporting(callback): detect(...); plan_merge(...)`` calls ``callback(text)`` from the
thread that runs them, at each phase ("reading rank files 3/8", "importing transformers for
the architecture check", "building Qwen2ForCausalLM on the meta device"). Outside such a block
:func:`phase` does nothing. The callback is per thread, so a background check in the app does
not report into a command's display.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

_local = threading.local()


@contextlib.contextmanager
def reporting(callback: Callable[[str], None] | None) -> Iterator[None]:
    """Send this thread's :func:`phase` reports to ``callback`` (None: nowhere) inside the
    block; the previous callback comes back after it."""
    old = getattr(_local, "callback", None), getattr(_local, "last", None)
    _local.callback, _local.last = callback, None
    try:
        yield
    finally:
        _local.callback, _local.last = old


def phase(text: str) -> None:
    """Report ``text`` (one line, no newline) to this thread's callback, if any; the same
    text twice in a row is reported once (two steps may announce the same phase)."""
    cb = getattr(_local, "callback", None)
    if cb is not None and text != getattr(_local, "last", None):
        _local.last = text
        cb(text)
