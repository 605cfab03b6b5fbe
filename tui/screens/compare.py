"""The compare view (``c`` in the inspector): the open checkpoint against a second one, each
tensor's change (sortable by change, filterable) and a per-layer bar chart of relative change.
The comparison is :func:`core.diff.diff_checkpoints`, run in a thread."""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, Static


class ComparePathScreen(ModalScreen[str | None]):
    """Ask for the second checkpoint's path (dismisses with it, or None)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    ComparePathScreen { align: center middle; }
    #compare-form { width: 80; height: auto; border: round $accent; padding: 1 2; }
    """

    def compose(self) -> ComposeResult:
        with Vertical(id="compare-form"):
            yield Label("compare with the checkpoint at (any format; LoRA sides: use "
                        "`shardscope diff --lora`):")
            yield Input(placeholder="path of the second checkpoint", id="compare-path")
            yield Button("Compare", id="compare-ok", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#compare-path", Input).focus()

    @on(Input.Submitted, "#compare-path")
    @on(Button.Pressed, "#compare-ok")
    def _ok(self) -> None:
        value = self.query_one("#compare-path", Input).value.strip()
        self.dismiss(os.path.expanduser(value) if value else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


@dataclass
class DiffDone(Message):
    """The comparison finished: ``result`` (a DiffResult) or ``error`` (one line)."""

    result: object | None
    error: str = ""


@dataclass
class DiffStep(Message):
    done: int
    total: int
    name: str


def layer_bars(result, width: int = 30) -> str:
    """Rich markup: one line per layer, a bar of its relative change ||B-A||/||A|| scaled to
    the largest finite one."""
    layers = result.by_layer()
    finite = [lc.rel_change for lc in layers if lc.rel_change is not None
              and math.isfinite(lc.rel_change)]
    peak = max(finite, default=0.0)
    pad = max((len(lc.layer) for lc in layers), default=0)
    lines = []
    for lc in layers:
        r = lc.rel_change
        if r is None:
            bar, val = "", "-"
        elif not math.isfinite(r):
            bar, val = "[red]∞[/]", str(r)
        else:
            n = round(width * r / peak) if peak else 0
            bar, val = "[b]" + "█" * n + "[/]", f"{r:.3g}"
        lines.append(f"{lc.layer:<{pad}}  {val:>9}  {bar}")
    return "\n".join(lines)


class CompareScreen(Screen):
    """Tensors of A (the open checkpoint) against B, with their change."""

    BINDINGS = [
        Binding("o", "sort", "Sort", id="sort", tooltip="Sort by change / by name"),
        Binding("slash", "filter", "Filter", id="filter", tooltip="Filter tensors by name"),
        Binding("escape", "back", "Back", id="back", tooltip="Back to the inspector"),
    ]

    DEFAULT_CSS = """
    #diff-summary { height: auto; padding: 0 1; }
    #diff-filter { display: none; }
    #diff-table { height: 2fr; border: round $accent; }
    #diff-layers { height: 1fr; border: round $accent; overflow-y: auto; }
    """

    def __init__(self, a: str, b: str):
        super().__init__()
        self.a, self.b = a, b
        self.result = None
        self.by_change = True
        self.cancel = threading.Event()
        self.title = f"shardscope — {os.path.basename(a)} vs {os.path.basename(b)}"

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"comparing {self.a}\n     with {self.b} …", id="diff-summary")
        yield Input(placeholder="filter tensors", id="diff-filter")
        table = DataTable(id="diff-table", cursor_type="row")
        table.border_title = "tensors (by change)"
        yield table
        bars = Static("", id="diff-layers")
        bars.border_title = "relative change by layer"
        yield bars
        yield Footer()

    def on_mount(self) -> None:
        filt = self.query_one("#diff-filter", Input)
        filt.display, filt.cursor_blink = False, False
        table = self.query_one("#diff-table", DataTable)
        table.add_columns("tensor", "status", "||B-A||/||A||", "max |B-A|", "cosine")
        table.focus()
        self.run_diff()

    def on_unmount(self) -> None:
        self.cancel.set()

    @work(thread=True, group="diff", exclusive=True, exit_on_error=False,
          description="compare checkpoints")
    def run_diff(self) -> None:
        from core import ShardscopeError
        from core.diff import diff_checkpoints

        try:
            result = diff_checkpoints(
                self.a, self.b, cancel=self.cancel,
                on_progress=lambda d, t, n: self.post_message(DiffStep(d, t, n)))
        except ShardscopeError as e:
            self.post_message(DiffDone(None, str(e)))
            return
        self.post_message(DiffDone(result))

    @on(DiffStep)
    def _step(self, msg: DiffStep) -> None:
        if self.result is None:
            self.query_one("#diff-summary", Static).update(
                f"comparing {msg.done}/{msg.total}: {msg.name}")

    @on(DiffDone)
    def _done(self, msg: DiffDone) -> None:
        box = self.query_one("#diff-summary", Static)
        if msg.result is None:
            box.update(f"[red]{msg.error}[/]")
            return
        self.result = r = msg.result
        counts = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in r.counts().items() if n)
        verdict = "[green]identical bit for bit[/]" if r.same else "[red]different[/]"
        box.update(f"A: {r.a} ({r.format_a})\nB: {r.b} ({r.format_b})\n{verdict}: {counts}")
        self.query_one("#diff-layers", Static).update(layer_bars(r))
        self.fill()

    def rows(self) -> list:
        """The tensors shown: filtered by name, sorted by change (largest first) or name."""
        if self.result is None:
            return []
        text = self.query_one("#diff-filter", Input).value.strip().lower()
        ts = [t for t in self.result.tensors if text in t.name.lower()]
        if self.by_change:
            rank = {"only_a": 4, "only_b": 4, "shape": 3, "dtype": 2}

            def key(t):
                r = t.rel_change if t.rel_change is not None and not math.isnan(t.rel_change) \
                    else -1.0
                return (rank.get(t.status, 1 if t.status != "identical" else 0), r)

            ts = sorted(ts, key=key, reverse=True)
        return ts

    def fill(self) -> None:
        table = self.query_one("#diff-table", DataTable)
        table.clear()

        def g(x):
            return "-" if x is None else f"{x:.4g}"

        colors = {"identical": "green", "close": "green", "changed": "yellow"}
        for t in self.rows():
            c = colors.get(t.status, "red")
            table.add_row(t.name, f"[{c}]{t.status.replace('_', ' ')}[/]", g(t.rel_change),
                          g(t.max_abs), g(t.cosine), key=t.name)
        table.border_title = f"tensors ({'by change' if self.by_change else 'by name'})"

    def action_sort(self) -> None:
        self.by_change = not self.by_change
        self.fill()

    def action_filter(self) -> None:
        box = self.query_one("#diff-filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#diff-filter")
    def _filter(self) -> None:
        self.fill()

    @on(Input.Submitted, "#diff-filter")
    def _filter_done(self) -> None:
        self.query_one("#diff-table", DataTable).focus()

    def action_back(self) -> None:
        box = self.query_one("#diff-filter", Input)
        if box.display:
            box.value = ""
            box.display = False
            self.query_one("#diff-table", DataTable).focus()
        else:
            self.cancel.set()
            self.app.pop_screen()
