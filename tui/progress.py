"""Rich progress for ``shardscope merge``: one bar per source file (bytes read of it) and one
overall (bytes written), fed by the core's thread-safe progress callback."""

from __future__ import annotations


import threading

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TransferSpeedColumn)

from shardscope.core import MergePlan, MergeProgress
from shardscope.tui.format import short_path

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


class NodeProgressView:
    """Rich progress of one process of ``merge --distributed``: one line per node. The writer
    shows every process's line (the bytes of rank-file pieces it read from its own disk or
    received from that process) and the bytes written; another process shows its own line
    (the bytes it sent). :meth:`update` is the ``on_progress`` callback (thread-safe), fed
    :class:`core.distributed.NodeProgress` and, on the writer, ``MergeProgress``."""

    def __init__(self, console: Console):
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 DownloadColumn(binary_units=False), TransferSpeedColumn(),
                                 TimeElapsedColumn(), console=console, transient=False)
        self.lock = threading.Lock()
        self.nodes: dict[int, int] = {}
        self.overall: int | None = None

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, ev) -> None:
        from shardscope.core.distributed import NodeProgress

        with self.lock:
            if isinstance(ev, NodeProgress):
                task = self.nodes.get(ev.rank)
                if task is None:
                    verb = "read on its disk (writer)" if ev.writer else "sent to the writer"
                    task = self.nodes[ev.rank] = self.progress.add_task(
                        f"node {ev.node_rank} rank {ev.rank}: {verb}", total=ev.total)
                self.progress.update(task, completed=ev.done, total=ev.total)
            elif isinstance(ev, MergeProgress):
                if self.overall is None:
                    self.overall = self.progress.add_task("[bold]write", total=ev.bytes_total)
                self.progress.update(self.overall, completed=ev.bytes_written,
                                     description=f"[bold]write[/] {ev.tensors_done}/"
                                                 f"{ev.tensors_total} tensors")
