"""Textual's Footer, recomposed once per change of the keys it shows.

Textual's ``Footer`` recomposes (new ``FooterKey`` widgets, styled and laid out) after every
``bindings_updated`` signal of its screen (``textual/widgets/_footer.py``,
``bindings_changed``): mounting the inspector sends several (focus moves, widgets shown or
hidden) and it built its keys 6 times, ~40 keys, before the first paint. This one queues at
most one recompose at a time and skips it when the keys shown are the same."""

from __future__ import annotations

from textual.widgets import Footer as TextualFooter


class Footer(TextualFooter):
    """A ``Footer`` that recomposes only when the shown keys (key, action, description,
    enabled, tooltip) changed."""

    _queued = False
    _shown: tuple | None = None

    def _keys(self) -> tuple:
        return tuple((b.key, b.action, b.description, b.show, enabled, tooltip)
                     for _, b, enabled, tooltip in self.screen.active_bindings.values())

    def bindings_changed(self, screen) -> None:
        self._bindings_ready = True
        if not screen.app.app_focus:
            return
        if self.is_attached and screen is self.screen and not self._queued:
            self._queued = True
            self.call_after_refresh(self._recompose_if_changed)

    async def _recompose_if_changed(self) -> None:
        self._queued = False
        if not self.is_attached:
            return
        keys = self._keys()
        if keys != self._shown:
            self._shown = keys
            await self.recompose()
