"""Help: what each key does, screen by screen. Laid out as a two-column grid (keys, then what
they do, wrapped at the window's width) that scrolls when the terminal is small (80x24)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

#: (section, [(keys, what they do)]) — every binding of every screen, and the widgets' own keys
KEYS: list[tuple[str, list[tuple[str, str]]]] = [
    ("browser", [
        ("↑ ↓", "move; each folder is marked with the checkpoint found in it"),
        ("enter", "expand a folder, or open the checkpoint in it"),
        ("o", "open the highlighted folder"),
        ("backspace", "go up to the parent folder"),
    ]),
    ("inspector", [
        ("↑ ↓", "select a tensor: its pieces (which rank and file hold which slice)"),
        ("space, enter", "expand or collapse a group of the parameter tree"),
        ("/", "filter the tree (fuzzy); enter jumps to the first match, escape clears"),
        ("v", "map: how the selected tensor is cut, a block per stored piece"),
        ("s", "statistics of the selected tensor, read from the shards"),
        ("n", "group the tree by the checkpoint's own names (Megatron)"),
        ("tab", "next panel (shift+tab: previous); click a tab to switch it"),
        ("c", "compare with a second checkpoint: each tensor's change, by layer"),
        ("m", "merge into a Hugging Face folder"),
        ("escape", "back to the browser"),
    ]),
    ("compare view", [
        ("o", "sort the tree by change (largest first) or by name"),
        ("/", "filter the tree (fuzzy); enter jumps to the first match, escape clears"),
        ("escape", "cancel a running comparison, then back to the inspector"),
    ]),
    ("merge form", [
        ("tab", "next field (shift+tab: previous)"),
        ("space", "tick or untick a checkbox; open a list"),
        ("enter", "merge (the form refuses bad values first)"),
        ("escape", "close the form"),
    ]),
    ("merge run", [
        ("escape", "cancel (nothing is left at the output), then back"),
    ]),
    ("anywhere", [
        ("?", "this help"),
        ("ctrl+p", "command palette"),
        ("q", "quit (asks first during a merge)"),
    ]),
]


def help_table() -> Table:
    """The keys as a Rich grid: a bold section line, then key and description columns."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True, min_width=12)
    grid.add_column(ratio=1)
    grid.add_row("[b]shardscope[/]", "inspect and merge distributed checkpoints")
    for section, rows in KEYS:
        grid.add_row("", "")
        grid.add_row(f"[b u]{section}[/]", "")
        for keys, what in rows:
            grid.add_row(keys, what)
    grid.add_row("", "")
    grid.add_row("", "[dim]escape, ? or q closes this help[/]")
    return grid


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", id="close-help")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(help_table(), id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)
