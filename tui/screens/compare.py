"""The compare view (``c`` in the inspector): the open checkpoint (A) against a second one (B).

The parameter tree (:class:`tui.widgets.param_tree.ParamTree`, the inspector's widget) with
each tensor's verdict — identical, its relative change ||B-A||/||A||, a shape or dtype that
differs, only in A or only in B —, sortable by change (``o``) and fuzzy-filtered (``/``); the
highlighted tensor's statistics; a bar chart of relative change per layer (Rich ``Bar``s in a
Rich ``Table``). The comparison is :func:`core.diff.diff_checkpoints`, run in a thread worker
(group ``diff``) whose progress the screen polls into a progress bar; escape cancels it."""

from __future__ import annotations

import math
import os
import threading

from rich.bar import Bar
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.suggester import Suggester
from textual.widgets import Button, Footer, Header, Input, Label, ProgressBar, Select, Static, Tree

from shardscope.tui.messages import DiffFailed, DiffFinished
from shardscope.tui.widgets.param_tree import ParamTree


class FolderSuggester(Suggester):
    """Completes the last part of a typed path with the first sub-folder of its parent that
    starts with it (right arrow takes it), so a sibling step is a few keys away."""

    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        head, tail = os.path.split(value)
        folder = os.path.expanduser(head) or "."
        try:
            names = sorted(e.name for e in os.scandir(folder)
                           if e.is_dir() and e.name.startswith(tail) and e.name != tail
                           and not e.name.startswith("."))
        except OSError:
            return None
        return os.path.join(head, names[0]) if names else None


class ComparePathScreen(ModalScreen[dict | None]):
    """Ask for the second checkpoint: its path, what to do with a side that holds a LoRA
    adapter, and a config folder for a side without one (dismisses with a dict of
    :class:`core.diff.SideOptions` fields plus ``path``, or None)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, start: str = "") -> None:
        super().__init__()
        #: the path the field starts with (the open checkpoint's parent folder)
        self.start = start

    def compose(self) -> ComposeResult:
        with Vertical(id="compare-form"):
            yield Label("compare with the checkpoint at (any format; → completes a folder):")
            yield Input(self.start, placeholder="path of the second checkpoint",
                        suggester=FolderSuggester(), select_on_focus=False,
                        id="compare-path")
            yield Label("a side holding a LoRA adapter:")
            yield Select([("fold the adapter into its base (as merge --lora fold)", "fold"),
                          ("its base weights alone (--lora base)", "base")],
                         value="fold", allow_blank=False, id="compare-lora")
            yield Input(placeholder="config folder for a side without one (optional)",
                        id="compare-config")
            yield Button("Compare", id="compare-ok", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#compare-path", Input).focus()

    @on(Input.Submitted)
    @on(Button.Pressed, "#compare-ok")
    def _ok(self) -> None:
        value = self.query_one("#compare-path", Input).value.strip()
        if not value:
            self.dismiss(None)
            return
        config = self.query_one("#compare-config", Input).value.strip()
        self.dismiss({"path": os.path.expanduser(value),
                      "lora": self.query_one("#compare-lora", Select).value,
                      "hf_config": os.path.expanduser(config) if config else None})

    def action_cancel(self) -> None:
        self.dismiss(None)


#: sort rank of a status: kinds of difference first, then changed tensors by their change
_KIND = {"only_a": 4, "only_b": 4, "shape": 3, "dtype": 2, "changed": 1, "close": 1,
         "identical": 0}


def change_rank(t) -> tuple[int, float]:
    """Sort key of a :class:`core.diff.TensorDiff`, larger first: tensors on one side only,
    then shape, then dtype differences, then by relative change (infinite above finite)."""
    r = t.rel_change
    if t.nonfinite:  # NaN/Inf appeared or went: above every finite change
        return _KIND.get(t.status, 1), math.inf
    return _KIND.get(t.status, 1), (-1.0 if r is None or math.isnan(r) else r)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def verdict(t) -> str:
    """Rich markup of a tensor's verdict (short, for a tree leaf)."""
    s = t.status
    if t.nonfinite and s in ("changed", "close", "dtype"):  # no size to show: what changed
        return f"[red]{s} {t.nonfinite}[/]"
    if s == "identical":
        return "[green]identical[/]"
    if s == "close":
        return f"[green]close[/] {_g(t.rel_change)}"
    if s == "changed":
        return f"[yellow]changed[/] {_g(t.rel_change)}"
    if s == "dtype":
        return f"[red]dtype {t.dtype_a}→{t.dtype_b}[/] {_g(t.rel_change)}"
    if s == "shape":
        return f"[red]shape {list(t.shape_a)}→{list(t.shape_b)}[/]"
    return "[red]only in A[/]" if s == "only_a" else "[red]only in B[/]"


def diff_label(key: str, t) -> str:
    """A compare tree leaf: the last name part and its verdict."""
    return f"{escape(key)}  {verdict(t)}"


def group_note(items: list) -> str:
    """A compare tree group: how many of its tensors are not identical."""
    moved = sum(t.status != "identical" for t in items)
    if not moved:
        return "[dim green]identical[/]"
    return f"[yellow]{moved}/{len(items)} differ[/]"


def detail_text(t) -> str:
    """Rich markup: everything the diff knows of one tensor."""
    lines = [f"[b]{escape(t.name)}[/]  {verdict(t)}"]
    a = f"{t.dtype_a} {list(t.shape_a)}" if t.shape_a is not None else "-"
    b = f"{t.dtype_b} {list(t.shape_b)}" if t.shape_b is not None else "-"
    lines.append(f"A {a}   B {b}")
    if t.status not in ("shape", "only_a", "only_b"):
        n = math.prod(t.shape_a or ())
        differ = "-" if t.differing is None else f"{t.differing}/{n}"
        lines.append(f"max |B-A| {_g(t.max_abs)}  ||B-A||/||A|| {_g(t.rel_change)}  "
                     f"cosine {_g(t.cosine)}  differ {differ}")
        if t.nonfinite:
            lines.append(f"[red]NaN/Inf differ: {t.nonfinite}[/] (NaN A {t.nan_a} B {t.nan_b}, "
                         f"Inf A {t.inf_a} B {t.inf_b})")
    return "\n".join(lines)


def _prefix(names: list[str]) -> str:
    """The dotted prefix every name shares, short of the last two parts (``model.`` of
    ``model.layers.3``, so the chart says ``layers.3``), or ''."""
    parts = [n.split(".")[:-2] for n in names]
    if len(parts) < 2:
        return ""
    common = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        common.append(xs[0])
    return ".".join(common) + "." if common else ""


def layer_chart(result) -> tuple[Table, str | None]:
    """(a Rich table of one row per layer: name, ||B-A||/||A|| and a bar scaled to the
    largest finite change, the layer that moved most, or None when none moved). Layers whose
    tensors could not be compared (shape, one side only) show ``-`` and no bar; an infinite
    change (||A|| = 0) shows ``inf`` and a layer whose tensors gained or lost NaN/Inf shows
    ``NaN``, each with a full red bar."""
    layers = result.by_layer()
    finite = [lc.rel_change for lc in layers if lc.rel_change is not None
              and math.isfinite(lc.rel_change)]
    peak = max(finite, default=0.0)
    top = max((lc for lc in layers if lc.rel_change is not None and lc.rel_change > 0
               and not math.isnan(lc.rel_change)),
              key=lambda lc: lc.rel_change, default=None)
    cut = _prefix([lc.layer for lc in layers if lc.layer != "(other)"])
    table = Table(box=None, show_header=False, expand=True, padding=(0, 1, 0, 0))
    table.add_column("layer", no_wrap=True)
    table.add_column("change", justify="right", no_wrap=True)
    table.add_column("bar", ratio=1, min_width=4)
    for lc in layers:
        name = lc.layer[len(cut):] if lc.layer.startswith(cut) else lc.layer
        r = lc.rel_change
        mark = top is not None and lc.layer == top.layer
        style = "bold red" if mark else ""
        if lc.nonfinite:
            table.add_row(Text(name, style=style), Text("NaN", style="red"),
                          Bar(1, 0, 1, color="red"))
        elif r is None or math.isnan(r):
            table.add_row(Text(name, style=style), "-", "")
        elif not math.isfinite(r):
            table.add_row(Text(name, style=style), "inf", Bar(1, 0, 1, color="red"))
        else:
            # the share of the peak, rounded: the largest change is a full bar whatever the
            # last bits of the float division (Rich truncates r/peak*width*8 to eighths)
            table.add_row(Text(name, style=style), f"{r:.3g}",
                          Bar(1.0, 0, round(r / peak, 6) if peak else 0.0,
                              color="red" if mark else "yellow"))
    return table, (top.layer if top is not None else None)


def side_names(a: str, b: str) -> tuple[str, str]:
    """``a`` and ``b`` relative to the folder that holds both (``step1``, ``step2``), or as
    given when they share no folder below the root."""
    a, b = os.path.abspath(a), os.path.abspath(b)
    common = os.path.commonpath([a, b])
    if common in ("/", a, b):
        return a, b
    return os.path.relpath(a, common), os.path.relpath(b, common)


class CompareScreen(Screen):
    """The tensors of A (the open checkpoint) against B, with their change."""

    BINDINGS = [
        Binding("o", "sort", "Sort", id="sort", tooltip="Sort by change / by name"),
        Binding("slash", "filter", "Filter", id="filter", tooltip="Filter tensors by name"),
        Binding("escape", "back", "Cancel / back", id="back",
                tooltip="Cancel a running comparison; else back to the inspector"),
    ]

    def __init__(self, a: str, b: str, lora: str | None = "fold", hf_config: str | None = None):
        super().__init__()
        self.a, self.b = a, b
        self.lora, self.hf_config = lora, hf_config
        #: the :class:`core.diff.DiffResult`, once the worker has finished
        self.result = None
        #: the worker stopped (finished, failed or cancelled)
        self.finished = False
        #: the tree was filled and the cursor put on its first tensor (after the result)
        self.landed = False
        self.cancelled = False
        #: the layer with the largest relative change (the chart's marked bar), or None
        self.top_layer: str | None = None
        self.by_change = True
        self.cancel = threading.Event()
        self.lock = threading.Lock()
        self.progress: tuple[int, int, str] | None = None  # set by the worker thread
        self.title = f"shardscope — {os.path.basename(os.path.abspath(a))} vs " \
                     f"{os.path.basename(os.path.abspath(b))}"

    def compose(self) -> ComposeResult:
        yield Header()
        a, b = side_names(self.a, self.b)
        yield Static(f"A: {escape(a)}\nB: {escape(b)}", id="diff-summary")
        with Horizontal(id="diff-progress-row"):
            yield Label("reading both sides…", id="diff-status")
            yield ProgressBar(id="diff-progress", show_eta=False)
        with Horizontal(id="diff-main"):
            with Vertical(id="diff-left"):
                yield Input(placeholder="filter tensors (fuzzy)", id="diff-filter")
                tree = ParamTree({}, label=diff_label, group_note=group_note, rank=change_rank,
                                 id="diff-tree")
                tree.border_title = "tensors, by change"
                tree.border_subtitle = "change: ||B-A||/||A||"
                yield tree
                detail = Static("", id="diff-detail")
                detail.border_title = "selected tensor"
                yield detail
            box = VerticalScroll(Static("", id="diff-layers"), id="diff-layers-box")
            box.border_title = "||B-A||/||A|| by layer"
            yield box
        yield Footer()

    def on_mount(self) -> None:
        filt = self.query_one("#diff-filter", Input)
        filt.display, filt.cursor_blink = False, False
        self.query_one("#diff-tree", ParamTree).focus()
        self.set_interval(0.2, self._poll)
        self.run_diff()

    def on_unmount(self) -> None:
        self.cancel.set()

    def _on_progress(self, done: int, total: int, name: str) -> None:
        """Called from the worker thread: only stores the counters (the screen polls)."""
        with self.lock:
            self.progress = (done, total, name)

    @work(thread=True, group="diff", exclusive=True, exit_on_error=False,
          description="compare checkpoints")
    def run_diff(self) -> None:
        from shardscope.core import MergeCancelled, ShardscopeError
        from shardscope.core.diff import SideOptions, diff_checkpoints

        side = SideOptions(hf_config=self.hf_config, lora=self.lora)
        try:
            result = diff_checkpoints(self.a, self.b, side_a=side, side_b=side,
                                      cancel=self.cancel, on_progress=self._on_progress)
        except MergeCancelled:
            self.post_message(DiffFailed("cancelled", True))
            return
        except ShardscopeError as e:
            self.post_message(DiffFailed(str(e), False))
            return
        except OSError as e:
            self.post_message(DiffFailed(f"{e.filename or ''}: {e.strerror or e}", False))
            return
        self.post_message(DiffFinished(result))

    def _poll(self) -> None:
        if self.finished:
            return
        with self.lock:
            p = self.progress
        if p is None:
            return
        done, total, name = p
        self.query_one("#diff-progress", ProgressBar).update(total=total, progress=done)
        self.query_one("#diff-status", Label).update(f"{done}/{total} {name}")

    def _stop_bar(self) -> None:
        bar = self.query_one("#diff-progress", ProgressBar)
        if bar.total is None:  # never started: a still 0 % instead of the busy animation
            bar.update(total=1, progress=0)

    @on(DiffFailed)
    def _failed(self, msg: DiffFailed) -> None:
        self.finished = True
        self._stop_bar()
        if msg.cancelled:
            self.cancelled = True
            done = self.progress[0] if self.progress else 0
            self.query_one("#diff-status", Label).update(
                f"[yellow]cancelled after {done} tensor(s)[/]; escape: back")
        else:
            self.query_one("#diff-status", Label).update("[red b]refused[/]; escape: back")
            self.query_one("#diff-summary", Static).update(f"[red]{escape(msg.error)}[/]")

    @on(DiffFinished)
    def _finished(self, msg: DiffFinished) -> None:
        self.finished = True
        self.result = r = msg.result
        self.query_one("#diff-progress-row").display = False
        counts = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in r.counts().items() if n)
        head = (f"[green b]{escape(r.same_text().split(':')[0])}[/]" if r.same
                else "[red b]different[/]")
        gained = sum(bool(t.nonfinite) for t in r.tensors)
        if gained:
            counts += f" [red]({gained} in NaN/Inf)[/]"
        warn = "".join(f"\n[yellow]warning:[/] {escape(w)}" for w in r.warnings)
        a, b = side_names(r.a, r.b)
        self.query_one("#diff-summary", Static).update(
            f"A: {escape(a)} [dim]({r.format_a})[/]\nB: {escape(b)} [dim]({r.format_b})[/]"
            f"\n{head}: {counts} (of {len(r.tensors)}){warn}")
        chart, self.top_layer = layer_chart(r)
        self.query_one("#diff-layers", Static).update(chart)
        tree = self.query_one("#diff-tree", ParamTree)
        tree.set_items({t.name: t for t in r.tensors})
        self.call_after_refresh(self._land)

    def _land(self) -> None:
        """Put the cursor on the first tensor shown (the largest change when sorted)."""
        tree = self.query_one("#diff-tree", ParamTree)
        leaf = tree.first_leaf()
        if leaf is not None:
            tree.reveal(leaf)
            # said here too: a cursor that stays on the same line after a rebuild posts no
            # NodeHighlighted, and the panel would keep the previous tensor
            self.query_one("#diff-detail", Static).update(detail_text(leaf.data))
        else:
            self.query_one("#diff-detail", Static).update("[dim]no tensor matches[/]")
        self.landed = True

    @on(Tree.NodeHighlighted, "#diff-tree")
    def _show(self, event: Tree.NodeHighlighted) -> None:
        t = event.node.data
        self.query_one("#diff-detail", Static).update(
            detail_text(t) if t is not None else "[dim]a group: select a tensor[/]")

    def rows(self) -> list[str]:
        """The tensor names in the tree's display order (every group expanded or not)."""
        return [n.data.name for n in self.query_one("#diff-tree", ParamTree).leaves()]

    def action_sort(self) -> None:
        self.by_change = not self.by_change
        tree = self.query_one("#diff-tree", ParamTree)
        tree.set_rank(change_rank if self.by_change else None)
        tree.border_title = "tensors, by change" if self.by_change else "tensors, by name"
        if self.result is not None:
            self.call_after_refresh(self._land)

    def action_filter(self) -> None:
        box = self.query_one("#diff-filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#diff-filter")
    def _filter(self, event: Input.Changed) -> None:
        self.query_one("#diff-tree", ParamTree).set_filter(event.value)

    @on(Input.Submitted, "#diff-filter")
    def _filter_done(self) -> None:
        self.query_one("#diff-tree", ParamTree).focus()
        if self.result is not None:
            self.call_after_refresh(self._land)

    def action_back(self) -> None:
        box = self.query_one("#diff-filter", Input)
        if box.display:
            box.value = ""
            box.display = False
            self.query_one("#diff-tree", ParamTree).focus()
        elif not self.finished:
            self.query_one("#diff-status", Label).update("cancelling…")
            self.cancel.set()
        else:
            self.app.pop_screen()
