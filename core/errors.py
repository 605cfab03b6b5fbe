"""Errors raised by the core.

Every error carries the file it concerns (``path``) and a one-line message, so the command
line can print ``shardscope: <path>: <message>`` and exit without a traceback.
"""

from __future__ import annotations


class ShardscopeError(Exception):
    """Base class. ``exit_code`` is what the command line exits with (3: bad checkpoint)."""

    exit_code = 3
    #: a stable code for ``inspect --json`` (e.g. ``path-outside-checkpoint``, ``wrong-folder``)
    code = "bad-checkpoint"

    def __init__(self, message: str, path: str | None = None, *, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = path
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class BadCheckpointError(ShardscopeError):
    """The input cannot be read as a checkpoint (unknown format, corrupt or inconsistent files)."""


class UnsafeCheckpointError(BadCheckpointError):
    """A pickle names a global outside the known tensor records (it could run code on load)."""

    code = "unsafe-pickle"


class UsageError(ShardscopeError):
    """The user asked for something impossible (exit code 2)."""

    exit_code = 2
    code = "usage"


class OutputExistsError(UsageError):
    """The output folder exists and ``overwrite`` was not given."""


class OutputWriteError(UsageError):
    """A file of the output cannot be written (disk full, quota, read-only file system, file
    size limit): the output's problem, never the checkpoint's (exit code 2). ``path`` is the
    output folder; the message names the file inside it and the system's reason."""

    code = "output-not-writable"


class MergeCancelled(ShardscopeError):
    """The merge was cancelled through its ``threading.Event``; nothing was left at the output."""

    exit_code = 130


class ReadCancelled(MergeCancelled):
    """Reading a layout was cancelled through the ``threading.Event`` given to
    :func:`core.phases.watching` (checked by the readers between files)."""
