"""Help: what each key does."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """[b]shardscope[/] — inspect and merge distributed checkpoints

[b]browser[/]    arrows move, enter expands/opens, o opens the highlighted folder
[b]inspector[/]  / filters the parameter tree (fuzzy), arrows select a tensor and show its
           pieces (which rank and file hold which slice), m opens the merge options,
           escape goes back
[b]merge[/]      escape cancels (nothing is left at the output), then goes back
[b]anywhere[/]   ? this help, ctrl+p command palette, q quit

escape closes this help"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", id="close-help")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")

    def action_close(self) -> None:
        self.dismiss(None)
