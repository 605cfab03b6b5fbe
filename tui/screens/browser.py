"""The browser: a directory tree; the highlighted folder is detected in a thread and marked
with its format and world size; Enter (or o) opens a checkpoint."""

from __future__ import annotations


from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DirectoryTree, Footer, Header, Label

from tui.messages import FolderDetected


class CheckpointTree(DirectoryTree):
    """Shows folders only, each marked with the format detected in it (when known)."""

    def __init__(self, path: str, marks: dict[str, str], **kw):
        super().__init__(path, **kw)
        self.marks = marks

    def filter_paths(self, paths):
        return [p for p in paths if p.is_dir() and not p.name.startswith(".")]

    def render_label(self, node, base_style, style):
        label = super().render_label(node, base_style, style)
        mark = self.marks.get(str(node.data.path)) if node.data else None
        if mark:
            label.append(f"  [{mark}]", style="bold green")
        return label


class BrowserScreen(Screen):
    """Pick a checkpoint folder."""

    BINDINGS = [Binding("o", "open", "Open", id="open", tooltip="Open the highlighted folder")]

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.marks: dict[str, str] = {}
        self.highlighted: str = path

    def compose(self) -> ComposeResult:
        yield Header()
        tree = CheckpointTree(self.path, self.marks, id="tree")
        tree.border_title = "folders"
        yield tree
        yield Label("highlight a folder; o or enter opens a checkpoint", id="detected")
        yield Footer()

    @on(DirectoryTree.NodeHighlighted)
    def _highlighted(self, event) -> None:
        if event.node.data is not None:
            self.highlighted = str(event.node.data.path)
            self.sniff(self.highlighted)

    @work(thread=True, group="sniff", exclusive=True, exit_on_error=False,
          description="detect format")
    def sniff(self, path: str) -> None:
        from core import ShardscopeError, detect
        from core.formats import _readers

        summary = ""
        if any(mod.sniff(path) for _, mod in _readers()):
            try:
                layout = detect(path)
                summary = f"{layout.format}, {layout.world_size} rank(s)"
                if layout.errors:
                    summary += f", {len(layout.errors)} problem(s)"
            except ShardscopeError as e:
                summary = f"unreadable: {e.message}"
        self.post_message(FolderDetected(path, summary))

    @on(FolderDetected)
    def _detected(self, msg: FolderDetected) -> None:
        if msg.summary:
            self.marks[msg.path] = msg.summary
            self.query_one("#tree", CheckpointTree).refresh()
        text = f"{msg.path}: {msg.summary or 'no checkpoint here'}"
        self.query_one("#detected", Label).update(text)

    @on(DirectoryTree.DirectorySelected)
    def _selected(self, event) -> None:
        path = str(event.path)
        if self.marks.get(path):
            self.app.open_checkpoint(path)

    def action_open(self) -> None:
        self.app.open_checkpoint(self.highlighted)
