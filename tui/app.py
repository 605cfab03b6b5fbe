"""The Textual app: opens the browser, or the inspector when given a checkpoint. Thin: screens
do the work; the app only routes between them and loads layouts in a worker."""

from __future__ import annotations

import os

from textual import on, work
from textual.app import App, SystemCommand
from textual.binding import Binding

from shardscope.tui.messages import LayoutFailed, LayoutLoaded


class ShardscopeApp(App):
    """shardscope's terminal app."""

    CSS_PATH = "app.tcss"
    TITLE = "shardscope"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit", tooltip="Quit (asks first during a merge)"),
        Binding("question_mark", "help", "Help", id="help", tooltip="Show the keys"),
    ]

    def __init__(self, path: str | None = None):
        super().__init__()
        self.start_path = os.path.abspath(path or os.getcwd())

    def on_mount(self) -> None:
        from shardscope.core.formats import _readers
        from shardscope.tui.screens.browser import BrowserScreen

        folder = self.start_path if os.path.isdir(self.start_path) else \
            os.path.dirname(self.start_path)
        self.push_screen(BrowserScreen(folder))
        if any(mod.sniff(folder) for _, mod in _readers()):
            self.open_checkpoint(folder)

    def open_checkpoint(self, path: str) -> None:
        """Read ``path``'s layout in a thread; the inspector opens when it is loaded."""
        self.load_layout(path)

    @work(thread=True, group="layout", exclusive=True, exit_on_error=False,
          description="read layout")
    def load_layout(self, path: str) -> None:
        from shardscope.core import ShardscopeError, detect

        try:
            self.post_message(LayoutLoaded(detect(path)))
        except ShardscopeError as e:
            self.post_message(LayoutFailed(path, str(e)))

    @on(LayoutLoaded)
    def _loaded(self, msg: LayoutLoaded) -> None:
        from shardscope.tui.screens.inspector import InspectorScreen

        self.push_screen(InspectorScreen(msg.layout))

    @on(LayoutFailed)
    def _failed(self, msg: LayoutFailed) -> None:
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
