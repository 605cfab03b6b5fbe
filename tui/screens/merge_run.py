"""The merge run: a thread worker runs the core; the screen polls shared counters (so a fast
merge never floods the message queue) and shows one bar per source file and one overall; an
upload to the Hub after the merge gets a bar of bytes sent, polled the same way.
Escape cancels: the core sees the worker's cancel event and removes its temporary folder."""

from __future__ import annotations

import threading
import time

from rich.markup import escape
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, ProgressBar, Static
from textual.worker import get_current_worker

from shardscope.core import (CheckpointLayout, MergeCancelled, MergeOptions, MergeProgress,
                  ShardscopeError, plan_merge, run_merge)
from shardscope.tui.format import human_bytes, short_path
from shardscope.tui.messages import MergeFailed, MergeFinished

MAX_FILE_BARS = 16


class MergeRunScreen(Screen):
    """Runs one merge and shows its progress, then its result."""

    BINDINGS = [Binding("escape", "cancel", "Cancel / back", id="cancel-merge")]

    def __init__(self, layout: CheckpointLayout, options: MergeOptions):
        super().__init__()
        self.ckpt, self.options = layout, options
        self.latest: MergeProgress | None = None
        self.per_source: dict[str, int] = {}
        self.lock = threading.Lock()
        self.finished = False
        self.plan = None
        self.uploading = False  # the status line then stays "uploading to …"
        self.uploaded: tuple[int, int] | None = None  # bytes sent, total; set by the worker
        self.phase: str | None = None  # the planning step under way; set by the worker
        self.shown_phase: str | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="run"):
            yield Label(f"merging {self.ckpt.path} -> {self.options.output}", id="what")
            yield Label("planning…", id="status")
            yield Label("written (all output files)")
            yield ProgressBar(id="overall", show_eta=False)
            yield VerticalScroll(id="sources")
            yield Label("uploaded", id="upload-label", classes="upload")
            yield ProgressBar(id="upload", show_eta=False, classes="upload")
            yield Static("", id="result")
        yield Footer()

    def on_mount(self) -> None:
        self.started = time.monotonic()
        self.run_merge()
        self.set_interval(0.2, self._poll)

    def on_progress(self, ev: MergeProgress) -> None:
        """Called from the worker thread: only stores counters."""
        with self.lock:
            self.latest = ev
            if ev.source:
                self.per_source[ev.source] = ev.source_read

    def on_phase(self, text: str) -> None:
        """Called from the worker thread while planning (core/phases.py: importing
        transformers, building the model for the architecture check, ...): only stores it."""
        with self.lock:
            self.phase = text

    def on_upload_progress(self, done: int, total: int) -> None:
        """Called from the worker thread during the upload: only stores the byte counts."""
        with self.lock:
            self.uploaded = (done, total)

    @work(thread=True, group="merge", exclusive=True, exit_on_error=False,
          description="merge")
    def run_merge(self) -> None:
        cancel = get_current_worker().cancelled_event  # set by escape (and q, quitting)
        try:
            from shardscope.core.phases import reporting

            def on_phase(text: str) -> None:
                # each planning step: escape stops the merge there (planning can take a
                # minute on a loaded machine: torch and transformers imported cold)
                if cancel.is_set():
                    raise MergeCancelled("merge cancelled")
                self.on_phase(text)

            with reporting(on_phase):
                plan = plan_merge(self.ckpt, self.options)
            if cancel.is_set():  # nothing of the merge written, not even its temporary folder
                raise MergeCancelled("merge cancelled")
            self.plan = plan
            self.app.call_from_thread(self._show_plan, plan)
            result = run_merge(plan, on_progress=self.on_progress, cancel=cancel)
            from shardscope.core.verify import verify_folder

            problems = [f"{p.code}: {p.message}" for p in verify_folder(result.output)
                        if p.severity == "error"]
            if self.options.hf_upload and not problems:
                from shardscope.core.publish import upload

                self.app.call_from_thread(self._show_upload)
                url = upload(result.output, self.options.hf_upload,
                             private=self.options.private, progress=self.on_upload_progress)
                result.warnings.append(f"uploaded to {url}")
            self.post_message(MergeFinished(result, problems))
        except MergeCancelled:
            self.post_message(MergeFailed("cancelled; nothing was written", True))
        except ShardscopeError as e:
            from shardscope.tui.screens.merge_options import form_words

            self.post_message(MergeFailed(form_words(str(e)), False))
        except OSError as e:  # e.g. the output's disk is full or read-only
            self.post_message(MergeFailed(f"{e.filename or ''}: {e.strerror or e}", False))

    def _show_plan(self, plan) -> None:
        self.query_one("#overall", ProgressBar).update(total=plan.total_bytes)
        self.query_one("#status", Label).update(
            f"{plan.tensor_count} tensors -> {len(plan.files)} file(s), "
            f"{human_bytes(plan.total_bytes)}")
        box = self.query_one("#sources", VerticalScroll)
        if len(plan.source_bytes) <= MAX_FILE_BARS:
            for i, (path, total) in enumerate(plan.source_bytes.items()):
                box.mount(Label(f"read {short_path(path, plan.layout.path)}"))
                box.mount(ProgressBar(total=total, show_eta=False, id=f"src-{i}"))

    def _show_upload(self) -> None:
        self.uploading = True
        self.query_one("#status", Label).update(f"uploading to {self.options.hf_upload}…")
        for w in self.query(".upload"):
            w.display = True

    def _poll(self) -> None:
        if self.plan is None:
            with self.lock:
                text = self.phase
            if text is not None and text != self.shown_phase and not self.finished:
                self.shown_phase = text
                self.query_one("#status", Label).update(f"{escape(text)}…")
            return
        with self.lock:
            ev, per, uploaded = self.latest, dict(self.per_source), self.uploaded
        if uploaded is not None:
            done, total = uploaded
            self.query_one("#upload", ProgressBar).update(total=total, progress=done)
            self.query_one("#upload-label", Label).update(
                f"uploaded {human_bytes(done)} of {human_bytes(total)}")
        if ev is None:
            return
        self.query_one("#overall", ProgressBar).update(progress=ev.bytes_written)
        if not self.finished and not self.uploading:
            elapsed = time.monotonic() - self.started
            rate = ev.bytes_written / elapsed if elapsed > 0 else 0
            self.query_one("#status", Label).update(
                f"{ev.tensors_done}/{ev.tensors_total} tensors, "
                f"{human_bytes(ev.bytes_written)} of {human_bytes(ev.bytes_total)}, "
                f"{human_bytes(rate)}/s, {elapsed:.0f} s  {ev.tensor}")
        for i, path in enumerate(self.plan.source_bytes):
            bars = self.query(f"#src-{i}")
            if bars and path in per:
                bars.first(ProgressBar).update(progress=per[path])

    @on(MergeFinished)
    def _finished(self, msg: MergeFinished) -> None:
        self.finished = True
        self._poll()
        r = msg.result
        # the whole run from the form's submit (planning included, as the CLI's summary says)
        total = max(time.monotonic() - self.started, r.seconds)
        lines = [f"[green b]done[/] in {total:.2f} s (planning {total - r.seconds:.2f} s, "
                 f"writing {r.seconds:.2f} s): {r.tensors} tensors, "
                 f"{human_bytes(r.tensor_bytes)} -> {r.output}"]
        lines += [f"  {name}  {human_bytes(size)}" for name, size in r.files]
        lines += [f"[yellow]warning:[/] {w}" for w in r.warnings]
        lines.append("[green]verified: keys and shapes match[/]" if not msg.problems
                     else "[red]verification found:[/] " + "; ".join(msg.problems))
        lines.append("[dim]escape: back to the inspector[/]")
        self.query_one("#status", Label).update("finished")
        self.query_one("#result", Static).update("\n".join(lines))

    @on(MergeFailed)
    def _failed(self, msg: MergeFailed) -> None:
        """Stop every bar where it is (an unplanned bar would animate on and look busy) and
        show the whole message, wrapped, with the way back."""
        self.finished = True
        for bar in self.query(ProgressBar):
            if bar.total is None:  # never planned: a still 0 % instead of the busy animation
                bar.update(total=1, progress=0)
        if msg.cancelled:
            self.query_one("#status", Label).update(f"[yellow]{escape(msg.error)}[/]")
        else:
            self.query_one("#status", Label).update("[red b]the merge failed[/]; nothing was "
                                                    "written")
        self.query_one("#result", Static).update(
            ("" if msg.cancelled else f"[red]{escape(msg.error)}[/]\n\n")
            + "[dim]escape: back to the inspector[/]")

    def action_cancel(self) -> None:
        if self.finished:
            self.app.pop_screen()
            return
        self.query_one("#status", Label).update("cancelling…")
        self.workers_cancel()

    def workers_cancel(self) -> None:
        for w in self.app.workers:
            if w.group == "merge":
                w.cancel()
