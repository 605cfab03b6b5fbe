"""The browser: a directory tree of folders. Every folder the tree lists is detected in the
background and marked with its format and world size as each answer arrives; Enter (or o)
opens a checkpoint; Backspace goes up to the parent folder."""

from __future__ import annotations

import os

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DirectoryTree, Footer, Header, Label
from textual.worker import get_current_worker

from shardscope.tui.messages import FolderDetected, FoldersListed


class CheckpointTree(DirectoryTree):
    """Shows folders only, each marked with the format detected in it (when known), or
    with the checkpoints found in its sub-folders when it holds none itself."""

    def __init__(self, path: str, marks: dict[str, str],
                 inside: dict[str, list[str]] | None = None, **kw):
        super().__init__(path, **kw)
        self.marks = marks
        self.inside = {} if inside is None else inside

    def filter_paths(self, paths):
        """Folders only, hidden ones left out; the screen is told which (to sniff them)."""
        shown = [p for p in paths if p.is_dir() and not p.name.startswith(".")]
        self.post_message(FoldersListed([str(p) for p in shown]))
        return shown

    def refresh_path(self, path: str) -> None:
        """Repaint the row(s) of the folder ``path`` after its mark arrived. Textual's Tree
        caches each rendered line under a key that includes the node's update count
        (``textual/widgets/_tree.py``, ``_render_line``), so a plain ``refresh()`` repaints
        the old label; ``TreeNode.refresh()`` bumps that count."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.data is not None and str(node.data.path) == path:
                node.refresh()
            stack.extend(node.children)

    def render_label(self, node, base_style, style):
        label = super().render_label(node, base_style, style)
        path = str(node.data.path) if node.data else None
        mark = self.marks.get(path) if path else None
        if mark:
            label.append(f"  [{mark}]", style="bold green")
        elif mark == "" and self.inside.get(path):
            names = self.inside[path]
            if len(names) == 1:
                sub = self.marks.get(os.path.join(path, names[0]), "")
                label.append(f"  [{names[0]}: {sub}]", style="green")
            else:
                label.append(f"  [{len(names)} checkpoints inside]", style="green")
        return label


class BrowserScreen(Screen):
    """Pick a checkpoint folder."""

    BINDINGS = [
        Binding("o", "open", "Open", id="open", tooltip="Open the highlighted folder"),
        Binding("backspace", "up", "Parent", id="parent", tooltip="Go up to the parent folder"),
    ]

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        #: folder -> its summary ("fsdp, 2 rank(s)"), or "" when it holds no checkpoint
        self.marks: dict[str, str] = {}
        #: folders being sniffed now (so a folder listed and highlighted is sniffed once)
        self.pending: set[str] = set()
        #: folders the tree shows as rows (the others were only sniffed)
        self.shown: set[str] = {path}
        #: folders without a checkpoint whose sub-folders were listed to be sniffed
        self.looked_inside: set[str] = set()
        #: folder -> names of its sub-folders that hold a checkpoint (sorted)
        self.inside: dict[str, list[str]] = {}
        self.highlighted: str = path

    def compose(self) -> ComposeResult:
        yield Header()
        tree = CheckpointTree(self.path, self.marks, self.inside, id="tree")
        tree.border_title = self.path
        yield tree
        yield Label("highlight a folder; enter or o opens a checkpoint; backspace goes up",
                    id="detected")
        yield Footer()

    def on_mount(self) -> None:
        self.sniff_folders([self.path])

    def sniff_folders(self, paths: list[str]) -> None:
        """Sniff, in the background, each of ``paths`` not known nor being sniffed."""
        # the checkpoint the app is reading now is marked from that read (app.py sends
        # FolderDetected): a second full read beside it would halve the speed of both
        opening = self.app.loading_path()
        todo = [p for p in dict.fromkeys(paths) if p not in self.marks and p not in self.pending
                and p != opening]
        if todo:
            self.pending.update(todo)
            self.sniff_all(todo)

    @on(FoldersListed)
    def _listed(self, msg: FoldersListed) -> None:
        """The tree shows these folders: sniff each, and look inside those known to hold
        no checkpoint."""
        self.shown.update(msg.paths)
        self.sniff_folders(msg.paths)
        for p in msg.paths:
            if self.marks.get(p) == "":
                self._look(p)

    def _look(self, path: str) -> None:
        """Sniff the sub-folders of ``path`` (once), in the background."""
        if path not in self.looked_inside:
            self.looked_inside.add(path)
            self.look_inside(path)

    @on(DirectoryTree.NodeHighlighted)
    def _highlighted(self, event) -> None:
        if event.node.data is not None:
            self.highlighted = str(event.node.data.path)
            if self.highlighted in self.marks:
                self._show(self.highlighted)
            else:
                self.query_one("#detected", Label).update(f"{self.highlighted}: detecting…")
                if self.highlighted not in self.pending and \
                        self.highlighted != self.app.loading_path():
                    self.pending.add(self.highlighted)
                    self.sniff(self.highlighted)

    @work(thread=True, group="sniff", exit_on_error=False, description="detect formats")
    def sniff_all(self, paths: list[str]) -> None:
        """Detect each folder in turn, posting one :class:`FolderDetected` per answer."""
        worker = get_current_worker()
        for path in paths:
            if worker.is_cancelled:
                return
            self.post_message(FolderDetected(path, _summary(path)))

    @work(thread=True, group="sniff", exit_on_error=False, description="detect format")
    def sniff(self, path: str) -> None:
        self.post_message(FolderDetected(path, _summary(path)))

    @work(thread=True, group="sniff", exit_on_error=False, description="list sub-folders")
    def look_inside(self, path: str) -> None:
        """List the sub-folders of ``path`` (a shown folder without a checkpoint, maybe not
        expanded) so that each is sniffed, and the row and the status line can name the
        checkpoints inside (verl's ``global_step_N/actor``). One level only: they are not
        rows, so nothing below them is looked into."""
        try:
            with os.scandir(path) as it:
                subs = sorted(e.path for e in it if not e.name.startswith(".")
                              and e.is_dir(follow_symlinks=True))
        except OSError:
            return
        if subs:
            self.app.call_from_thread(self.sniff_folders, subs)

    @on(FolderDetected)
    def _detected(self, msg: FolderDetected) -> None:
        self.marks[msg.path] = msg.summary
        self.pending.discard(msg.path)
        tree = self.query_one("#tree", CheckpointTree)
        parent = os.path.dirname(msg.path)
        if msg.summary:
            names = self.inside.setdefault(parent, [])
            if os.path.basename(msg.path) not in names:
                names.append(os.path.basename(msg.path))
                names.sort()
            tree.refresh_path(msg.path)
            tree.refresh_path(parent)  # its "checkpoints inside" mark
        elif msg.path in self.shown:
            self._look(msg.path)
        if msg.path == self.highlighted:
            self._show(msg.path)
        elif msg.summary and parent == self.highlighted and self.highlighted in self.marks:
            self._show(self.highlighted)  # its "checkpoints inside" list grew

    def show_opening(self, path: str, text: str) -> None:
        """The status line while the app reads the checkpoint ``path`` it opens (readers
        that send counts but no preview: ``reading optimizer files 3/8``)."""
        self.query_one("#detected", Label).update(f"opening {path}: {text}")

    def _show(self, path: str) -> None:
        summary = self.marks.get(path, "")
        if not summary:
            if path in self.marks:
                self._look(path)
            inside = self.inside.get(path, [])
            summary = "no checkpoint here" + (
                f"; checkpoints inside: {', '.join(inside)}" if inside else "")
        self.query_one("#detected", Label).update(f"{path}: {summary}")

    @on(DirectoryTree.DirectorySelected)
    def _selected(self, event) -> None:
        path = str(event.path)
        if self.marks.get(path):
            self.app.open_checkpoint(path)

    def action_open(self) -> None:
        self.app.open_checkpoint(self.highlighted)

    def action_up(self) -> None:
        """Show the parent folder (as file browsers do on Backspace)."""
        parent = os.path.dirname(self.path.rstrip(os.sep)) or os.sep
        if parent == self.path:
            return
        self.path = self.highlighted = parent
        tree = self.query_one("#tree", CheckpointTree)
        tree.border_title = parent
        tree.path = parent
        self.shown.add(parent)
        self.sniff_folders([parent])
        if self.marks.get(parent) == "":
            self._look(parent)


def _summary(path: str) -> str:
    """:func:`folder_summary`, where a reader's unexpected exception marks that folder
    instead of ending the worker (which would leave every later folder unmarked)."""
    try:
        return folder_summary(path)
    except Exception as e:  # noqa: BLE001 - one bad folder must not stop the others
        return f"unreadable: {type(e).__name__}: {e}"


def folder_summary(path: str) -> str:
    """What a folder holds: ``"fsdp, 2 rank(s)"`` or ``"hf, 1 file"`` (with the count of
    problems found), ``"unreadable: <reason>"``, or ``""`` when no reader recognises it."""
    from shardscope.core import ShardscopeError, detect
    from shardscope.core.formats import _readers

    try:
        if not any(mod.sniff(path) for _, mod in _readers()):
            return ""
        layout = detect(path)
    except ShardscopeError as e:
        return f"unreadable: {e.message}"
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    return layout_summary(layout)


def layout_summary(layout) -> str:
    """The browser's mark for a read :class:`core.CheckpointLayout`: ``"fsdp, 2 rank(s)"``
    (a Hugging Face folder: ``"hf, 1 file"``, it has no ranks), with the count of errors when
    there are any."""
    if layout.format in ("hf", "hf-bin"):  # one model, no ranks: say how many weight files
        n = len(layout.files)
        summary = f"{layout.format}, {n} file{'s' if n != 1 else ''}"
    else:
        summary = f"{layout.format}, {layout.world_size} rank(s)"
    if layout.errors:
        summary += f", {len(layout.errors)} problem(s)"
    return summary
