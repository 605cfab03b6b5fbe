"""The Textual app: opens the browser, or the inspector when given a checkpoint. Thin: screens
do the work; the app only routes between them and loads layouts in a worker."""

from __future__ import annotations

import os
import threading

from textual import on, work
from textual.app import App, SystemCommand
from textual.binding import Binding

from shardscope.tui.messages import FolderDetected, LayoutFailed, LayoutLoaded, LayoutProgressed


class ShardscopeApp(App):
    """shardscope's terminal app."""

    CSS_PATH = "app.tcss"
    #: the inspector opens on a reader's preview when the rest of the files would take at
    #: least this many seconds more (else it opens once, on the full layout)
    PREVIEW_AFTER = 0.3
    TITLE = "shardscope"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit", tooltip="Quit (asks first during a merge)"),
        Binding("question_mark", "help", "Help", id="help", tooltip="Show the keys"),
    ]

    def __init__(self, path: str | None = None):
        super().__init__()
        self.start_path = os.path.abspath(path or os.getcwd())
        #: the checkpoint being read: (path opened, its cancel event), None when none
        self._loading: tuple[str, threading.Event] | None = None
        #: the folder the app was started in (or the checkpoint file's folder)
        self._folder = ""
        #: path -> summary of the layout the app read there, for a
        #: browser mounted later
        self._known: dict[str, str] = {}

    def on_mount(self) -> None:
        from shardscope.core.formats import _readers
        from shardscope.tui.screens.browser import BrowserScreen

        folder = self.start_path if os.path.isdir(self.start_path) else \
            os.path.dirname(self.start_path)
        self._folder = folder
        if any(mod.sniff(folder) for _, mod in _readers()):
            # the browser is mounted when the user goes back to it (:meth:`back`): the first
            # screen is the inspector, and mounting a screen never shown costs ~0.3 CPU s
            self.open_checkpoint(folder)
        else:
            self.push_screen(BrowserScreen(folder))

    def back(self) -> None:
        """Leave the top screen for the one under it, or for a new browser on the folder the
        app was started in when there is none (the app opened a checkpoint at once); it
        knows what the app read there."""
        from shardscope.tui.screens.browser import BrowserScreen

        if len(self.screen_stack) > 2:
            self.pop_screen()
            return
        browser = BrowserScreen(self._folder)
        browser.marks.update(self._known)
        self.switch_screen(browser)

    def open_checkpoint(self, path: str) -> None:
        """Read ``path``'s layout in a thread. The inspector opens on the reader's preview
        (what the first rank file says) in a loading state, and takes the full layout when
        every file is read; formats read at once open it loaded."""
        self.cancel_loading()
        self._loading = (path, threading.Event())
        self.load_layout(path, self._loading[1])

    def loading_path(self) -> str | None:
        """The path whose layout is being read now, or None."""
        return self._loading[0] if self._loading is not None else None

    def cancel_loading(self) -> None:
        """Stop the layout being read (the reader stops at its next file; nothing of it
        shows)."""
        if self._loading is not None:
            self._loading[1].set()
            self._loading = None
        self.workers.cancel_group(self, "layout")

    @work(thread=True, group="layout", exclusive=True, exit_on_error=False,
          description="read layout")
    def load_layout(self, path: str, cancel: threading.Event) -> None:
        from shardscope.core import ReadCancelled, ShardscopeError, detect
        from shardscope.core.phases import watching

        def report(progress) -> None:
            shown = threading.Event() if progress.preview is not None else None
            self.post_message(LayoutProgressed(path, progress, shown))
            if shown is not None:  # the first screen is painted on the event loop's thread:
                shown.wait(3)  # the reader pauses, not to take the CPU from it meanwhile

        try:
            with watching(report, cancel, preview_after=self.PREVIEW_AFTER):
                layout = detect(path)
            self.post_message(LayoutLoaded(layout, path))
        except ReadCancelled:
            pass
        except ShardscopeError as e:
            self.post_message(LayoutFailed(path, str(e)))

    def _current(self, path: str | None) -> bool:
        return path is None or (self._loading is not None and self._loading[0] == path)

    def _loading_screen(self, path: str):
        from shardscope.tui.screens.inspector import InspectorScreen

        return next((s for s in self.screen_stack if isinstance(s, InspectorScreen)
                     and s.loading_path == path), None)

    def _mark(self, path: str | None, layout) -> None:
        """Tell the browser what the read of ``path`` found: it does not read the checkpoint
        being opened a second time (BrowserScreen._sniff); after a failed read (None) it
        sniffs the folder itself."""
        from shardscope.tui.screens.browser import BrowserScreen, layout_summary

        if path is None:
            return
        if layout is not None:
            self._known[path] = layout_summary(layout)
        for s in self.screen_stack:
            if isinstance(s, BrowserScreen) and path not in s.marks:
                if layout is None:
                    s.sniff_folders([path])
                else:
                    s.post_message(FolderDetected(path, layout_summary(layout)))

    @on(LayoutProgressed)
    def _progressed(self, msg: LayoutProgressed) -> None:
        from shardscope.tui.screens.inspector import InspectorScreen

        screen = self._loading_screen(msg.path) if self._current(msg.path) else None
        if screen is not None:
            screen.show_progress(msg.progress)
        elif msg.progress.preview is not None and self._current(msg.path):
            screen = InspectorScreen(msg.progress.preview, loading=(msg.path, msg.progress))
            screen.shown = msg.shown
            self.push_screen(screen)
            return
        elif self._current(msg.path) and self.screen_stack and hasattr(
                self.screen_stack[-1], "show_opening"):  # no stack yet: the app is starting
            self.screen_stack[-1].show_opening(msg.path, msg.progress.text)  # no preview
        if msg.shown is not None:
            msg.shown.set()

    @on(LayoutLoaded)
    async def _loaded(self, msg: LayoutLoaded) -> None:
        from shardscope.tui.screens.inspector import InspectorScreen

        if not self._current(msg.path):
            return
        self._loading = None
        self._mark(msg.path, msg.layout)
        screen = self._loading_screen(msg.path) if msg.path else None
        if screen is not None:
            await screen.show_loaded(msg.layout)
        else:
            self.push_screen(InspectorScreen(msg.layout))

    @on(LayoutFailed)
    def _failed(self, msg: LayoutFailed) -> None:
        if not self._current(msg.path):
            return
        self._loading = None
        self._mark(msg.path, None)
        screen = self._loading_screen(msg.path)
        if screen is not None:
            screen.show_failed(msg.error)
        self.notify(msg.error, severity="error", timeout=8)

    def get_system_commands(self, screen):
        """The command palette: the app's commands plus one per binding of the screen."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "Show the keys", self.action_help)
        for binding in getattr(screen, "BINDINGS", []):
            action = getattr(screen, f"action_{binding.action}", None)
            if action is not None and binding.description:
                yield SystemCommand(binding.description, binding.tooltip or binding.description,
                                    action)

    def action_help(self) -> None:
        from shardscope.tui.screens.help import HelpScreen

        self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        merging = [w for w in self.workers if w.group == "merge" and w.is_running]
        if merging:
            from shardscope.tui.screens.merge_run import MergeRunScreen

            if isinstance(self.screen, MergeRunScreen) and not getattr(self, "_quit_armed", 0):
                self._quit_armed = 1
                self.notify("a merge is running: press q again to cancel it and quit",
                            severity="warning")
                return
            for w in merging:
                w.cancel()
            await self.workers.wait_for_complete(merging)
        self.exit()


def make_app(path: str | None = None) -> ShardscopeApp:
    """The app, as the command line, the tests and the screenshot script build it."""
    return ShardscopeApp(path)


def run_app(path: str | None = None) -> int:
    make_app(path).run()
    return 0
