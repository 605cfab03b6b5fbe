"""Messages posted by the app's workers (past tense: they report what happened)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from shardscope.core import CheckpointLayout, MergeResult


@dataclass
class LayoutLoaded(Message):
    """A checkpoint's layout was read (every file); ``path``: the path that was opened
    (None: not from the app's loader)."""

    layout: CheckpointLayout
    path: str | None = None


@dataclass
class LayoutProgressed(Message):
    """Reading the checkpoint opened at ``path`` went on: ``progress`` is a
    :class:`core.phases.ReadProgress` (files read, problems so far, once a preview layout)."""

    path: str
    progress: object
    #: with a preview: set once the screen showing it was painted (the reader waits for it,
    #: a few seconds at most, so that its thread does not slow the first screen down)
    shown: object = None


@dataclass
class LayoutFailed(Message):
    """Reading a checkpoint failed; ``error`` is the one-line message."""

    path: str
    error: str


@dataclass
class FolderDetected(Message):
    """The browser's background detection found (or not) a checkpoint in ``path``."""

    path: str
    summary: str


@dataclass
class FoldersListed(Message):
    """The browser's tree listed the sub-folders of one folder (each is then sniffed)."""

    paths: list[str]


@dataclass
class MergeFinished(Message):
    """A merge completed; ``problems`` are the quick verification's findings."""

    result: MergeResult
    problems: list[str]


@dataclass
class MergeFailed(Message):
    """A merge stopped: cancelled (``cancelled``) or failed with ``error``; nothing was left
    at the output."""

    error: str
    cancelled: bool


@dataclass
class StatsComputed(Message):
    """A tensor's statistics were read (``text``: markup to show, or the error)."""

    name: str
    text: str


@dataclass
class ArchitectureChecked(Message):
    """The background architecture check finished: ``verdict`` is the judge's
    :class:`core.judge.Verdict` on the checkpoint against its config's model class."""

    verdict: object


@dataclass
class DiffFinished(Message):
    """The compare view's diff finished: ``result`` is its :class:`core.diff.DiffResult`."""

    result: object


@dataclass
class DiffFailed(Message):
    """The compare view's diff stopped: cancelled (``cancelled``, escape) or refused with
    ``error`` (one line naming the checkpoint and the cause)."""

    error: str
    cancelled: bool
