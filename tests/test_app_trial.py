"""Pilot tests of what a trial user tripped on in the app: the browser's marks and status
line, the merge form's focus — on real checkpoints written by the fixtures."""

from __future__ import annotations

import pytest

from app_helpers import open_merge_form
from conftest import copy_checkpoint, wait_for
from test_merge_exact import assert_bit_equal, load
from shardscope.tui.app import make_app
from shardscope.tui.screens.browser import BrowserScreen

#: folder name in the test -> (fixture checkpoint, the mark the browser must show)
CHECKPOINTS = {
    "fsdp1-ranks": ("w2-fsdp1", "fsdp, 2 rank(s)"),
    "accelerate-ranks": ("w2-accelerate-rank", "fsdp, 2 rank(s)"),
    "llama-w3": ("w3-llama-f32", "fsdp, 3 rank(s)"),
    "hsdp-w4": ("w4-hsdp", "fsdp, 4 rank(s)"),
    "dcp-w2": ("w2-dcp", "dcp, 2 rank(s)"),
    "dcp-w3": ("w3-dcp", "dcp, 3 rank(s)"),
    "hf-folder": ("w1-fsdp2.reference", "hf, 1 file"),  # no ranks in a HF folder (trial3)
}


def tree_text(tree) -> list[str]:
    """The browser tree's rows as drawn now (through Tree's own line cache)."""
    return [tree.render_line(y).text.rstrip() for y in range(tree.size.height)]


@pytest.mark.asyncio
async def test_browser_draws_every_mark_as_it_arrives(fixtures_root, tmp_path):
    """Seven checkpoints of four kinds, a log folder and a verl step folder: every row shows
    its mark without the cursor moving (the step folder's row names its ``actor``), the
    status line of the highlighted parent grows with each answer, and names ``actor`` when
    the step folder is highlighted."""
    ck = tmp_path / "ck"
    ck.mkdir()
    for name, (fixture, _) in CHECKPOINTS.items():
        copy_checkpoint(fixtures_root / fixture, ck / name)
    (ck / "logs").mkdir()
    (ck / "global_step_5").mkdir()
    copy_checkpoint(fixtures_root / "w2-qwen2-f32", ck / "global_step_5" / "actor")
    app = make_app(str(ck))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, BrowserScreen))
        screen = app.screen
        tree = screen.query_one("#tree")
        status = screen.query_one("#detected")

        def all_drawn() -> bool:
            rows = tree_text(tree)
            return all(any(f"{name}  [{mark}]" in r for r in rows)
                       for name, (_, mark) in CHECKPOINTS.items())

        await wait_for(pilot, all_drawn, tries=600)
        # a folder without a checkpoint names the one inside it, the root counts them
        await wait_for(pilot, lambda: any("global_step_5  [actor: fsdp, 2 rank(s)]" in r
                                          for r in tree_text(tree)), tries=300)
        rows = tree_text(tree)
        assert rows[0].endswith("ck  [7 checkpoints inside]"), rows
        assert all("[" not in r for r in rows if "logs" in r), rows
        assert screen.highlighted == str(ck)  # the cursor never moved
        await wait_for(pilot, lambda: "checkpoints inside: " + ", ".join(sorted(CHECKPOINTS))
                       in str(status.render()), tries=100)
        step = next(n for n in tree.root.children if n.data.path.name == "global_step_5")
        assert not step.is_expanded
        tree.move_cursor(step)
        await wait_for(pilot, lambda: "global_step_5: no checkpoint here; checkpoints inside: "
                       "actor" in str(status.render()), tries=300)
        assert screen.marks[str(ck / "global_step_5" / "actor")] == "fsdp, 2 rank(s)"


@pytest.mark.asyncio
async def test_merge_form_takes_typing_at_once_and_enter_submits(fixtures_root, tmp_path):
    """The form opens with the output field focused (its default selected, so typing
    replaces it); Enter on a checkbox toggles it; Enter in the output field starts the
    merge, which is bit-exact."""
    from textual.widgets import Checkbox, Input

    from shardscope.tui.screens.merge_run import MergeRunScreen

    out = tmp_path / "typed-out"
    app = make_app(str(fixtures_root / "w2-qwen2-f32"))
    async with app.run_test(size=(80, 24)) as pilot:
        form = await open_merge_form(pilot, app)
        assert form.focused is form.query_one("#output", Input)
        await pilot.press(*str(out))
        assert form.query_one("#output", Input).value == str(out)
        box = form.query_one("#no-strict", Checkbox)
        box.focus()
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert box.value and app.screen is form  # toggled, not submitted
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert not box.value and app.screen is form
        form.query_one("#output", Input).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeRunScreen))
        run = app.screen
        await wait_for(pilot, lambda: run.finished, tries=1200)
        assert "verified" in str(run.query_one("#result").render())
    assert_bit_equal(load(out), load(fixtures_root / "w2-qwen2-f32.reference"))
