"""The inspector: summary, shard files, problems, parameter tree with a filter, and the pieces
of the selected tensor."""

from __future__ import annotations

import os

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import (DataTable, Header, Input, Label, ProgressBar, Static,
                             TabbedContent, TabPane, Tree)

from shardscope.core import CheckpointLayout, TensorInfo
from shardscope.tui.format import short_path
from shardscope.tui.messages import ArchitectureChecked, StatsComputed
from shardscope.tui.widgets.footer import Footer
from shardscope.tui.widgets.layout_summary import LayoutSummary
from shardscope.tui.widgets.param_tree import ParamTree
from shardscope.tui.widgets.shard_table import ShardTable
from shardscope.tui.widgets.sharding_map import ShardingMapView


def problems_text(layout: CheckpointLayout, problems=None, reading: str | None = None) -> str:
    """Rich markup listing ``problems`` (default: the layout's) and the layout's notes.
    ``reading``: the files are still being read (e.g. ``rank files 37/1024``): never "no
    problems found" then, only what was found so far."""
    problems = layout.problems if problems is None else problems
    if reading is not None:
        head = (f"[b red]{len(problems)} problem(s) so far[/]" if problems
                else "[dim]no problems so far[/]")
        lines = [head + f" [dim](reading {reading})[/]"]
    elif not problems:
        return "[green]no problems found[/]"
    else:
        lines = [f"[b red]{len(problems)} problem(s)[/]"]
    for p in problems:
        color = "red" if p.severity == "error" else "yellow"
        where = os.path.basename(p.path) if p.path else ""
        lines.append(f"[{color}]{p.code}[/] {where}: {p.message}")
    return "\n".join(lines + [f"[dim]note: {n}[/]" for n in layout.notes])


BARS = " ▁▂▃▄▅▆▇█"


def stats_text(st) -> str:
    """Rich markup for a :class:`core.stats.TensorStats`."""
    if st.min is None:
        return f"{st.name}: no finite values (NaN {st.nan}, Inf {st.inf})"
    peak = max(st.histogram) or 1
    spark = "".join(BARS[min(8, round(8 * c / peak))] for c in st.histogram)
    flag = "red" if st.nan or st.inf else "green"
    return (f"min {st.min:.4g}  max {st.max:.4g}  mean {st.mean:.4g}  std {st.std:.4g}\n"
            f"[{flag}]NaN {st.nan}  Inf {st.inf}[/]  zeros {st.zeros:.1%}\n"
            f"[b]{spark}[/]  ({st.min:.3g} .. {st.max:.3g})")


class InspectorScreen(Screen):
    """Everything the core knows about one checkpoint."""

    BINDINGS = [
        Binding("m", "merge", "Merge", id="merge", tooltip="Merge into a Hugging Face folder"),
        Binding("slash", "filter", "Filter", id="filter", tooltip="Filter the parameter tree"),
        Binding("s", "stats", "Stats", id="stats",
                tooltip="Statistics of the selected tensor, read from the shards"),
        Binding("v", "map", "Map", id="map",
                tooltip="Show how the selected tensor is cut: a block per stored piece"),
        Binding("n", "names", "Source names", id="names",
                tooltip="Group the tree by the checkpoint's own (e.g. Megatron) names"),
        Binding("c", "compare", "Compare", id="compare", show=False,
                tooltip="Compare with a second checkpoint (each tensor's change)"),
        Binding("escape", "back", "Back", id="back", tooltip="Back to the browser"),
    ]

    def __init__(self, layout: CheckpointLayout, loading: tuple[str, object] | None = None):
        """``layout``: the checkpoint's full layout; or, with ``loading`` = (path opened, its
        first :class:`core.phases.ReadProgress`), the reader's preview while the other files
        are read: the screen shows a progress bar and refuses what needs every file until
        :meth:`show_loaded` gives it the full layout."""
        super().__init__()
        self.ckpt = layout
        #: the path being read while this screen shows a preview (None: loaded)
        self.loading_path: str | None = loading[0] if loading else None
        #: the latest :class:`core.phases.ReadProgress` while loading
        self.progress = loading[1] if loading else None
        #: the reader's error when reading failed after the preview
        self.failed: str | None = None
        #: set (a ``threading.Event``, given by the app) once the preview is painted
        self.shown = None
        #: the full layout when it arrived before this screen was mounted
        self._pending: CheckpointLayout | None = None
        #: composed and mounting (widgets can be queried)
        self._ready = False
        #: the tensor whose statistics the panel shows or is reading (None: no tensor)
        self.stats_for: str | None = None
        #: the architecture check's verdict, once the background worker has posted it
        self.verdict = None
        # set before mount: a title set in on_mount races the Header's own mount
        self.title = f"shardscope — {os.path.basename(os.path.abspath(layout.path))}"

    def _problems(self) -> list:
        if self.progress is not None and self.loading_path is not None:
            return list(self.progress.problems)
        return self.ckpt.problems

    def _reading(self) -> str | None:
        p = self.progress
        return f"{p.what} {p.done}/{p.total}" if self.loading_path and p is not None else None

    def compose(self) -> ComposeResult:
        yield Header()
        if self.loading_path is not None and self.progress is not None:
            with Horizontal(id="loading"):
                yield Label(self.progress.text, id="loading-text")
                yield ProgressBar(total=self.progress.total, show_eta=False, id="loading-bar")
        with Horizontal():
            with Vertical(id="left"):
                summary = LayoutSummary(self.ckpt, id="summary")
                summary.border_title = "layout"
                yield summary
                # files and problems share the rest of the column (80x24); the problems
                # tab opens first when there are problems
                count = len(self._problems())
                with TabbedContent(id="files-problems",
                                   initial="tab-problems" if count else "tab-files"):
                    with TabPane(f"files ({len(self.ckpt.files)}"
                                 + (" so far)" if self.progress else ")"), id="tab-files"):
                        shards = ShardTable(self.ckpt, id="shards")
                        shards.border_title = "shard files" + (
                            "" if any(f.status != "ok" for f in self.ckpt.files)
                            else ", all ok")
                        yield shards
                    with TabPane(self._problems_label(), id="tab-problems"):
                        problems = Static(problems_text(self.ckpt, self._problems(),
                                                        self._reading()), id="problems")
                        problems.border_title = "problems"
                        yield VerticalScroll(problems, id="problems-box")
            with Vertical(id="right"):
                yield Input(placeholder="filter parameters (fuzzy)", id="filter")
                tree = ParamTree(self.ckpt.tensors, id="params")
                tree.border_title = "parameters"
                yield tree
                # what is known of the selected tensor, one tab at a time (fits 80x24)
                with TabbedContent(id="detail", initial="tab-pieces"):
                    with TabPane("pieces", id="tab-pieces"):
                        pieces = DataTable(id="pieces", cursor_type="row")
                        pieces.border_title = "pieces of the selected tensor"
                        yield pieces
                    with TabPane("map", id="tab-map"):
                        smap = ShardingMapView(id="map")
                        smap.border_title = "how the selected tensor is cut"
                        yield VerticalScroll(smap, id="map-box")
                    with TabPane("statistics", id="tab-stats"):
                        stats = Static("[dim]s: statistics of the selected tensor[/]",
                                       id="stats")
                        stats.border_title = "statistics"
                        yield stats
        yield Footer()

    def _problems_label(self) -> str:
        count = len(self._problems())
        if self.loading_path is not None and self.progress is not None:
            return f"problems ({count} so far)"
        return f"problems ({count})" if count else "no problems"

    def on_mount(self) -> None:
        self._ready = True
        self._setup()
        if self.loading_path is None:
            self.call_after_refresh(self.run_check)  # after the first screen: it imports torch
        else:
            self.show_progress(self.progress)
            self.query_one("#summary", LayoutSummary).border_subtitle = \
                "[dim]from the first rank file(s)[/]"
            if self.shown is not None:
                self.call_after_refresh(self.shown.set)
            if self._pending is not None:  # the full layout came before the first paint
                self.call_after_refresh(self.show_loaded, self._pending)

    def _setup(self) -> None:
        """What the widgets need after each compose (first mount, and :meth:`show_loaded`)."""
        self.query_one("#filter", Input).display = False
        self.query_one("#filter", Input).cursor_blink = False  # no repainting animation
        self.query_one("#pieces", DataTable).add_columns("rank", "offsets", "shape",
                                                         "bytes at", "file")
        self.query_one("#params", ParamTree).focus()

    def show_progress(self, progress) -> None:
        """Show a :class:`core.phases.ReadProgress` of the files still being read: the bar,
        its text and the problems found so far."""
        if self.loading_path is None or self.progress is None:
            return
        self.progress = progress
        if not self._ready:  # pushed, not composed yet (the reader stopped waiting for the
            return  # first paint after 3 s): on_mount shows the latest
        self.query_one("#loading-text", Label).update(progress.text)
        self.query_one("#loading-bar", ProgressBar).update(total=progress.total,
                                                           progress=progress.done)
        self.query_one("#problems", Static).update(
            problems_text(self.ckpt, self._problems(), self._reading()))
        self.query_one("#files-problems", TabbedContent).get_tab("tab-problems").label = \
            self._problems_label()

    async def show_loaded(self, layout: CheckpointLayout) -> None:
        """Take the full layout: the progress bar goes, the widgets show ``layout``, the
        tree cursor stays on the same tensor, the active tabs and the filter stay (but a
        layout with problems opens its problems tab, as the inspector always does), and the
        architecture check starts."""
        if not self.is_mounted:  # pushed, not mounted yet: on_mount takes it
            self._pending = layout
            return
        self._pending = None
        selected = self.selected_tensor()
        tabs = (self.query_one("#files-problems", TabbedContent).active,
                self.query_one("#detail", TabbedContent).active)
        box = self.query_one("#filter", Input)
        query = box.value if box.display else None
        self.ckpt, self.progress = layout, None
        self.stats_for = None
        await self.recompose()
        self._setup()
        self.loading_path = None
        problems, detail = self.query_one("#files-problems", TabbedContent), \
            self.query_one("#detail", TabbedContent)
        # a checkpoint with problems opens on them, as it would have without a preview
        problems.active = "tab-problems" if layout.problems else tabs[0]
        detail.active = tabs[1]
        tree = self.query_one("#params", ParamTree)
        if query:
            box = self.query_one("#filter", Input)
            box.display = True
            box.value = query
            tree.set_filter(query)
        node = tree.find(selected.name) if selected is not None else None
        if node is not None:
            tree.reveal(node)
        self.call_after_refresh(self.run_check)

    def show_failed(self, error: str) -> None:
        """Reading the files failed after the preview: say so on this screen (the bar's line
        turns into the error; merging stays refused)."""
        if not self._ready:  # pushed, not composed yet: once it is (the screen's queue runs
            self.call_later(self.show_failed, error)  # after its compose and mount)
            return
        self.failed, self.loading_path = error, None
        self.query_one("#loading-bar", ProgressBar).display = False
        text = self.query_one("#loading-text", Label)
        text.update(f"reading failed: {error}")
        text.add_class("failed")
        self.query_one("#problems", Static).update(f"[b red]reading failed:[/] {error}")
        self.query_one("#files-problems", TabbedContent).active = "tab-problems"

    def refused(self, what: str) -> bool:
        """True (and a notice saying why) when ``what`` needs every file and they are still
        being read, or reading them failed."""
        if self.failed is not None:
            self.notify(f"{what}: reading the checkpoint failed: {self.failed}",
                        severity="error")
            return True
        if self.loading_path is not None:
            self.notify(f"{what} needs every file: still "
                        f"{self.progress.text if self.progress else 'reading them'}",
                        severity="warning")
            return True
        return False

    @work(thread=True, group="check", exclusive=True, exit_on_error=False,
          description="architecture check")
    def run_check(self) -> None:
        """Judge the checkpoint against its config's model class (core/judge.py) in a
        thread; posts :class:`ArchitectureChecked`."""
        from shardscope.core.judge import Verdict, check_layout

        try:
            verdict = check_layout(self.ckpt)
        except Exception as e:  # noqa: BLE001 - shown, never a crash of the inspector
            verdict = Verdict(skipped=f"failed ({type(e).__name__}: {e})")
        self.post_message(ArchitectureChecked(verdict))

    @on(ArchitectureChecked)
    def _checked(self, msg: ArchitectureChecked) -> None:
        self.verdict = msg.verdict
        self.query_one("#summary", LayoutSummary).show_check(msg.verdict)

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "names":  # only readers that rename tensors (Megatron) record sources
            return any(t.source and t.source != t.name for t in self.ckpt.tensors.values())
        return True

    def action_map(self) -> None:
        if self.refused("the sharding map"):
            return
        self.query_one("#detail", TabbedContent).active = "tab-map"

    def action_names(self) -> None:
        tree = self.query_one("#params", ParamTree)
        tree.set_by_source(not tree.by_source)
        tree.border_title = ("parameters by source name" if tree.by_source else "parameters")

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def action_back(self) -> None:
        box = self.query_one("#filter", Input)
        if self.loading_path is not None and not box.display:  # stop reading, go back
            self.app.cancel_loading()
            self.loading_path = None
            if self.shown is not None:
                self.shown.set()  # a reader waiting for the first paint: on to its cancel
            self.app.back()
            return
        if box.display:
            box.value = ""
            box.display = False
            self.query_one("#params", ParamTree).focus()
        else:
            self.app.back()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.query_one("#params", ParamTree).set_filter(event.value)

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        tree = self.query_one("#params", ParamTree)
        tree.focus()
        leaf = tree.first_leaf()
        if leaf is not None:  # land on the first match, so its pieces show at once
            tree.move_cursor(leaf)

    @on(Tree.NodeHighlighted, "#params")
    def _show_pieces(self, event: Tree.NodeHighlighted) -> None:
        t = event.node.data
        table = self.query_one("#pieces", DataTable)
        table.clear()
        if not isinstance(t, TensorInfo):
            table.border_title = "pieces of the selected tensor"
            self._reset_stats(None)
            self.query_one("#map", ShardingMapView).show(None, self.ckpt)
            return
        table.border_title = f"{t.name}: {list(t.shape)} {t.dtype} {t.placement}" + (
            f" ← {t.source}" if t.source and t.source != t.name else "")
        if self.loading_path is not None and self.progress is not None:
            table.border_title += f" (pieces read so far, {self.progress.text})"
        self._reset_stats(t)
        if self.loading_path is None and self.failed is None:
            self.query_one("#map", ShardingMapView).show(t, self.ckpt)
        for p in sorted(t.pieces, key=lambda p: p.global_offsets):
            table.add_row("" if p.rank is None else str(p.rank), str(list(p.global_offsets)),
                          str(list(p.shape)),
                          "deferred" if p.archive is not None else str(p.byte_offset),
                          short_path(p.file, self.ckpt.path))

    def selected_tensor(self) -> TensorInfo | None:
        node = self.query_one("#params", ParamTree).cursor_node
        return node.data if node is not None and isinstance(node.data, TensorInfo) else None

    def _reset_stats(self, t: TensorInfo | None) -> None:
        """Statistics belong to one tensor: on a new selection the panel names it and drops
        the previous tensor's numbers (a computation still running for it is cancelled)."""
        box = self.query_one("#stats", Static)
        if self.stats_for == (t.name if t else None):
            return
        self.stats_for = t.name if t else None
        self.workers.cancel_group(self, "stats")
        box.border_title = f"statistics of {t.name}" if t else "statistics"
        box.update(f"[dim]s: read {t.name} and show its statistics[/]" if t
                   else "[dim]s: statistics of the selected tensor[/]")

    def action_stats(self) -> None:
        if self.refused("statistics"):
            return
        t = self.selected_tensor()
        box = self.query_one("#stats", Static)
        if t is None:
            box.update("[yellow]select a tensor first[/]")
            return
        self.stats_for = t.name
        self.query_one("#detail", TabbedContent).active = "tab-stats"
        box.border_title = f"statistics of {t.name}"
        box.update(f"reading {t.name} from {len(t.pieces)} piece(s)…")
        self.compute_stats(t.name)

    @work(thread=True, group="stats", exclusive=True, exit_on_error=False,
          description="tensor statistics")
    def compute_stats(self, name: str) -> None:
        from shardscope.core import ShardscopeError
        from shardscope.core.stats import tensor_stats

        try:
            text = stats_text(tensor_stats(self.ckpt, name))
        except ShardscopeError as e:
            text = f"[red]{e}[/]"
        self.post_message(StatsComputed(name, text))

    @on(StatsComputed)
    def _stats_computed(self, msg: StatsComputed) -> None:
        if msg.name == self.stats_for:  # late numbers of a tensor no longer selected: dropped
            self.query_one("#stats", Static).update(msg.text)

    def action_compare(self) -> None:
        if self.refused("compare"):
            return
        from shardscope.tui.screens.compare import ComparePathScreen, CompareScreen

        def start(choice: dict | None) -> None:
            if choice:
                self.app.push_screen(CompareScreen(self.ckpt.path, choice["path"],
                                                   lora=choice["lora"],
                                                   hf_config=choice["hf_config"]))

        parent = os.path.dirname(os.path.abspath(self.ckpt.path))
        self.app.push_screen(ComparePathScreen(os.path.join(parent, "")), start)

    def action_merge(self) -> None:
        if self.refused("merge"):
            return
        from shardscope.tui.screens.merge_options import MergeOptionsScreen
        from shardscope.tui.screens.merge_run import MergeRunScreen

        def start(options) -> None:
            if options is not None:
                self.app.push_screen(MergeRunScreen(self.ckpt, options))

        self.app.push_screen(MergeOptionsScreen(self.ckpt), start)
