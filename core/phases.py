"""Progress of the steps before a merge writes anything (reading the layout, planning), for
front ends: on a loaded machine reading many rank files or importing torch and transformers
for the architecture check takes tens of seconds, and a silent wait looks like a hang.

Two per-thread channels, both silent outside their ``with`` block:

- text: ``with reporting(callback): detect(...); plan_merge(...)`` calls ``callback(text)``
  from the thread that runs them, at each phase ("reading rank files 3/8", "importing
  transformers for the architecture check", "building Qwen2ForCausalLM on the meta device").
- structure: ``with watching(on_progress, cancel): detect(...)`` calls ``on_progress`` with a
  :class:`ReadProgress` (files done / total, copies of the problems found so far and, once, a
  *preview*: a snapshot :class:`CheckpointLayout` of what the first file(s) said) as a reader
  goes through its files, at most about ``1 / interval`` times a second, and makes the reader
  raise :class:`ReadCancelled` between files once ``cancel`` is set. Readers report with
  :func:`progressed`.

The callbacks run on the reader's thread; what :func:`progressed` sends are copies, never the
reader's live objects, so another thread may keep them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from typing import Callable, Iterator

from .errors import ReadCancelled
from .layout import CheckpointLayout, Problem

_local = threading.local()

#: updates that a newly found problem sends past the throttle, at most this many per read
#: (so the first problems show at once, and 1024 broken files still do not flood the UI)
PROBLEM_UPDATES = 16


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


@dataclasses.dataclass(frozen=True)
class ReadProgress:
    """Where a reader is: ``done`` of ``total`` files read (``what``: "rank files",
    "optimizer files"), ``problems``: copies of every problem found so far, ``preview``: a
    snapshot layout of what the files read so far say (format, world size, mesh, parallel
    degrees, tensors with their global shape/dtype/placement and the pieces read so far,
    config), sent in one update only; None in the others. The snapshot's own problems are
    those found when it was taken."""

    done: int
    total: int
    what: str = "rank files"
    problems: tuple[Problem, ...] = ()
    preview: CheckpointLayout | None = None

    @property
    def text(self) -> str:
        """``reading rank files 37/1024``."""
        return f"reading {self.what} {self.done}/{self.total}"


class _Watch:
    def __init__(self, on_progress, cancel, interval, preview_after):
        self.on_progress, self.cancel, self.interval = on_progress, cancel, interval
        self.preview_after = preview_after
        self.start = time.monotonic()
        self.last = float("-inf")
        self.previewed = False
        self.problems = 0
        self.forced = 0


@contextlib.contextmanager
def watching(on_progress: Callable[[ReadProgress], None] | None,
             cancel: threading.Event | None = None, interval: float = 0.1,
             preview_after: float = 0.0) -> Iterator[None]:
    """Send this thread's :func:`progressed` reports to ``on_progress`` as
    :class:`ReadProgress` (throttled: one every ``interval`` seconds, plus the preview, the
    last file and the first :data:`PROBLEM_UPDATES` new problems) inside the block, and make
    readers raise :class:`ReadCancelled` between files once ``cancel`` is set. The previous
    watch comes back after the block.

    ``preview_after``: a preview is built only when the files still to read would take at
    least this many seconds more at the pace so far (a front end that shows a preview and
    then the full layout pays for two screens: not worth it for a read about to end)."""
    old = getattr(_local, "watch", None)
    _local.watch = _Watch(on_progress, cancel, interval, preview_after)
    try:
        yield
    finally:
        _local.watch = old


def check_cancelled() -> None:
    """Raise :class:`ReadCancelled` when this thread's :func:`watching` block was cancelled."""
    w = getattr(_local, "watch", None)
    if w is not None and w.cancel is not None and w.cancel.is_set():
        raise ReadCancelled("reading cancelled")


def progressed(done: int, total: int, layout: CheckpointLayout | None = None,
               preview: Callable[[], CheckpointLayout] | None = None,
               what: str = "rank files") -> None:
    """A reader's report between files: ``done`` of ``total`` files read so far. ``layout``:
    the reader's live layout (its problems are copied into the update); ``preview``: builds
    a snapshot layout (see :func:`snapshot`) worth showing, called at most once per watch
    and only when someone watches, so readers pass it as soon as they have read enough.
    Raises :class:`ReadCancelled` when the watch was cancelled. Costs one attribute lookup
    outside a :func:`watching` block."""
    w = getattr(_local, "watch", None)
    if w is None:
        return
    if w.cancel is not None and w.cancel.is_set():
        raise ReadCancelled("reading cancelled")
    if w.on_progress is None:
        return
    now = time.monotonic()
    n_problems = len(layout.problems) if layout is not None else 0
    snap = None
    if preview is not None and not w.previewed and done < total and (
            (now - w.start) / max(done, 1) * (total - done) >= w.preview_after):
        snap, w.previewed = preview(), True
    elif now - w.last < w.interval and done < total:
        if n_problems <= w.problems or w.forced >= PROBLEM_UPDATES:
            return
        w.forced += 1
    w.last, w.problems = now, n_problems
    problems = tuple(copy.copy(p) for p in layout.problems) if layout is not None else ()
    w.on_progress(ReadProgress(done, total, what, problems, snap))


def snapshot(layout: CheckpointLayout) -> CheckpointLayout:
    """A copy of ``layout`` that shares nothing the reader goes on changing (tensors, their
    piece lists and pieces, files, problems, notes, dicts); ``resolve_piece`` is dropped
    (it reads the reader's live state)."""
    return dataclasses.replace(
        layout,
        parallel=dict(layout.parallel), details=dict(layout.details),
        tensors={n: dataclasses.replace(t, pieces=[copy.copy(p) for p in t.pieces])
                 for n, t in layout.tensors.items()},
        files=[copy.copy(f) for f in layout.files], extra_files=list(layout.extra_files),
        problems=[copy.copy(p) for p in layout.problems], notes=list(layout.notes),
        resolve_piece=None, derived_config=copy.deepcopy(layout.derived_config))
