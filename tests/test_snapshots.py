"""Snapshot tests (pytest-textual-snapshot) of each screen in a stable state, on real
fixtures. Update with ``pytest tests/test_snapshots.py --snapshot-update`` after a deliberate
change, and look at the SVGs before committing them."""

from __future__ import annotations

from conftest import inspector_ready, wait_for
from shardscope.tui.app import make_app
from shardscope.tui.screens.merge_options import MergeOptionsScreen

SIZE = (110, 34)


def test_inspector(snap_compare, fixtures_root):
    app = make_app(str(fixtures_root / "w4-hsdp"))

    async def ready(pilot):
        await inspector_ready(pilot, app, checked=True)
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_inspector_filtered(snap_compare, fixtures_root):
    app = make_app(str(fixtures_root / "w3-llama-f32"))

    async def ready(pilot):
        await inspector_ready(pilot, app, checked=True)
        # typed, not submitted: the pieces table stays empty, because the byte offsets it
        # shows differ between runs (a DTensor's pickle holds a per-process hash)
        await pilot.press("slash", *"embed")
        tree = app.screen.query_one("#params")
        await wait_for(pilot, lambda: len(tree.root.children) == 1, tries=200)
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_merge_options(snap_compare, fixtures_root):
    app = make_app(str(fixtures_root / "w2-dcp"))

    async def ready(pilot):
        await inspector_ready(pilot, app, checked=True)
        await pilot.press("m")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeOptionsScreen), tries=200)
        app.screen.query_one("#output").value = "merged_hf"
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_help(snap_compare, fixtures_root):
    app = make_app(str(fixtures_root / "w2-qwen2-f32"))

    async def ready(pilot):
        await inspector_ready(pilot, app, checked=True)
        await pilot.press("question_mark")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)
