"""Table of a checkpoint's files: rank, size, status."""

from __future__ import annotations

from textual.widgets import DataTable

from shardscope.core import CheckpointLayout
from shardscope.tui.format import human_bytes, short_path


def elide(text: str, width: int) -> str:
    """``text`` cut in the middle to ``width`` characters (``model_wo…rank_0.pt``): the end,
    where sharded file names keep their rank, stays readable."""
    if len(text) <= width or width < 5:
        return text
    folder, sep, name = text.rpartition("/")
    if sep and len(folder) + 6 <= width:  # mp_rank_01/model_optim_rng.pt: the folder ranks
        return folder + "/" + elide(name, width - len(folder) - 1)
    head = max(2, (width - 1) // 4)
    return text[:head] + "…" + text[-(width - 1 - head):]


def elide_all(names: list[str], width: int) -> list[str]:
    """Each of ``names`` cut to ``width`` characters keeping the part where they differ (the
    rank, in ``model_world_size_2_rank_0.pt`` or ``mp_rank_01/model_optim_rng.pt``): the
    common prefix and suffix are shortened first, around that part."""
    import os

    if len(names) < 2 or all(len(n) <= width for n in names):
        return [elide(n, width) for n in names]
    pre = len(os.path.commonprefix(names))
    suf = len(os.path.commonprefix([n[::-1] for n in names]))
    out = []
    for n in names:
        p, s = min(pre, len(n)), min(suf, len(n) - min(pre, len(n)))
        mid = n[p:len(n) - s]
        if len(n) <= width:
            out.append(n)
            continue
        room = width - len(mid) - 2  # two ellipses at most
        if room < 2:
            out.append(elide(n, width))
            continue
        before = min(p, (room + 1) // 2 + max(0, room // 2 - s))
        after = min(s, room - before)
        out.append(("…" if before < p else "") + n[p - before:p] + mid
                   + n[len(n) - s:len(n) - s + after] + ("…" if after < s else ""))
    return out


class ShardTable(DataTable):
    """One row per source file; file names elided in the middle to fit the width."""

    def __init__(self, layout: CheckpointLayout, **kw):
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.ckpt = layout
        self.rows_text: list[tuple[str, str, str, str]] = []
        self.fitted_to = -1

    def on_mount(self) -> None:
        # narrow terminals cut the last column: the file name goes last
        # a status column only when a file is not ok (the border title says "all ok")
        self.show_status = any(f.status != "ok" for f in self.ckpt.files)
        self.add_columns("rank", *(("status",) if self.show_status else ()), "size", "file")
        for f in sorted(self.ckpt.files, key=lambda f: (f.rank is None, f.rank or 0, f.path)):
            status = f.status if f.status == "ok" else f"[red]{f.status}[/]"
            self.rows_text.append(("" if f.rank is None else str(f.rank), status,
                                   human_bytes(f.bytes), short_path(f.path, self.ckpt.path)))
        self._fill()

    def on_resize(self) -> None:
        self._fill()

    def _fill(self) -> None:
        width = self.scrollable_content_region.width
        if width <= 0 or width == self.fitted_to:
            if not self.row_count:
                for row in self.rows_text:
                    self.add_row(*self._cells(row, 10_000))
            return
        self.fitted_to = width
        heads = [(0, "rank"), (1, "status"), (2, "size")][:: 1 if self.show_status else 2]
        fixed = sum(max([len(h)] + [len(r[i]) if "[" not in r[i] else len(r[i]) - 9
                                    for r in self.rows_text]) + 2 for i, h in heads)
        room = max(12, width - fixed - 3)
        self.clear()
        names = elide_all([r[3] for r in self.rows_text], room)
        for row, name in zip(self.rows_text, names):
            self.add_row(*self._cells(row[:3] + (name,), 10_000))

    def _cells(self, row, room: int) -> tuple[str, ...]:
        rank, status, size, name = row
        return (rank, *((status,) if self.show_status else ()), size, elide(name, room))
