"""Table of a checkpoint's files: rank, size, status."""

from __future__ import annotations



from textual.widgets import DataTable

from core import CheckpointLayout
from tui.format import human_bytes, short_path


class ShardTable(DataTable):
    """One row per source file."""

    def __init__(self, layout: CheckpointLayout, **kw):
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.ckpt = layout

    def on_mount(self) -> None:
        # narrow terminals cut the last column: the file name goes last
        self.add_columns("rank", "status", "size", "file")
        for f in sorted(self.ckpt.files, key=lambda f: (f.rank is None, f.rank or 0, f.path)):
            status = f.status if f.status == "ok" else f"[red]{f.status}[/]"
            self.add_row("" if f.rank is None else str(f.rank), status,
                         human_bytes(f.bytes), short_path(f.path, self.ckpt.path))
