"""Pilot steps shared by the app tests of what trial users tripped on (test_trial3.py,
test_app_trial.py)."""

from __future__ import annotations

from conftest import inspector_ready, wait_for


async def open_merge_form(pilot, app):
    """From the app started on a checkpoint: wait for the inspector, press ``m`` and wait
    until the merge form is mounted with its fields (a pushed screen is not yet composed on
    a loaded machine; its Selects finish mounting in the pause). Returns the form."""
    from shardscope.tui.screens.merge_options import MergeOptionsScreen

    await inspector_ready(pilot, app)
    await pilot.press("m")
    await wait_for(pilot, lambda: isinstance(app.screen, MergeOptionsScreen)
                   and app.screen.is_mounted and bool(app.screen.query("#output")))
    await pilot.pause(0.2)
    return app.screen
