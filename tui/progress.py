"""Rich progress for ``shardscope merge``: one bar per source file (bytes read of it) and one
overall (bytes written), fed by the core's thread-safe progress callback."""

from __future__ import annotations


import threading

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TransferSpeedColumn)

from core import MergePlan, MergeProgress
from tui.format import short_path

#: above this many source files, only the overall bar is shown (plus a count of files done)
MAX_FILE_BARS = 16


class MergeProgressView:
    """Context manager that shows progress for ``plan`` and whose :meth:`update` is the
    ``on_progress`` callback."""

    def __init__(self, plan: MergePlan, console: Console):
        self.plan = plan
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 DownloadColumn(binary_units=False), TransferSpeedColumn(),
                                 TimeElapsedColumn(), console=console, transient=False)
        self.lock = threading.Lock()
        self.tasks: dict[str, int] = {}
        self.files_done = 0
        per_file = len(plan.source_bytes) <= MAX_FILE_BARS
        if per_file:
            for path, total in plan.source_bytes.items():
                self.tasks[path] = self.progress.add_task(f"read {short_path(path, plan.layout.path)}",
                                                          total=total)
        self.overall = self.progress.add_task("[bold]write", total=plan.total_bytes)

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, ev: MergeProgress) -> None:
        with self.lock:
            if ev.source and ev.source in self.tasks:
                self.progress.update(self.tasks[ev.source], completed=ev.source_read)
            desc = "[bold]write"
            if ev.tensor:
                desc = f"[bold]write[/] {ev.tensors_done}/{ev.tensors_total} tensors"
            self.progress.update(self.overall, completed=ev.bytes_written, description=desc)
