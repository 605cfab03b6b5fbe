"""Snapshot tests at 80x24, the smallest terminal the app is laid out for (issue 16, item 7):
file names keep their rank, every shard row of a Megatron set shows, the form's buttons stay
on screen, the help is whole or scrolls. Update with ``--snapshot-update`` after a deliberate
change, and look at the SVGs before committing them."""

from __future__ import annotations

import html
import re

import pytest

from conftest import inspector_ready, wait_for
from shardscope.tui.app import make_app
from shardscope.tui.screens.merge_options import MergeOptionsScreen

SIZE = (80, 24)


async def inspector(pilot, app):
    await inspector_ready(pilot, app, checked=True)


def test_inspector_80x24_map(snap_compare, fixtures_root):
    app = make_app(str(fixtures_root / "w4-hsdp"))

    async def ready(pilot):
        await inspector(pilot, app)
        from test_app_usability import select

        await select(pilot, app.screen.query_one("#params"), "model.embed_tokens.weight")
        await pilot.press("v")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


@pytest.mark.asyncio
async def test_megatron_files_80x24(megatron_root):
    """Every shard row of a Megatron TP2 x PP2 set shows at 80x24, each with its rank folder.
    Not a snapshot: legacy Megatron files pickle the writer's Python RNG state, whose size
    varies from run to run, and the table shows file sizes."""
    pytest.importorskip("megatron.core")
    from shardscope.tui.widgets.shard_table import ShardTable

    app = make_app(str(megatron_root / "llama" / "tp2_pp2" / "legacy"))
    async with app.run_test(size=SIZE) as pilot:
        await inspector(pilot, app)
        app.screen.query_one("#files-problems").active = "tab-files"
        await pilot.pause(0.3)
        table = app.screen.query_one("#shards", ShardTable)
        assert table.row_count == 4
        svg = app.export_screenshot()
        shown = re.sub(r"&#160;|\s", "", html.unescape(svg))
        for folder in ("rank_00_000", "rank_01_000", "rank_00_001", "rank_01_001"):
            assert folder in shown, folder
        # the table is tall enough for its header and all four rows
        assert table.scrollable_content_region.height >= table.row_count + 1


def test_lora_form_80x24(snap_compare, fixtures_root):
    app = make_app(str(fixtures_root / "w2-lora-qv"))

    async def ready(pilot):
        await inspector(pilot, app)
        await pilot.press("m")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeOptionsScreen), tries=200)
        app.screen.query_one("#output").value = "merged_hf"
        app.screen.query_one("#fields").scroll_end(animate=False)
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_help_80x24(snap_compare, fixtures_root):
    app = make_app(str(fixtures_root / "w2-qwen2-f32"))

    async def ready(pilot):
        await inspector(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)
