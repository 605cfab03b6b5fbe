"""Pilot tests of what a new user tripped on in the app (issue 16), on real checkpoints."""

from __future__ import annotations

import pytest

from conftest import copy_checkpoint, inspector_ready, wait_for
from shardscope.tui.app import make_app
from shardscope.tui.screens.browser import BrowserScreen
from shardscope.tui.screens.inspector import InspectorScreen
from shardscope.tui.widgets.param_tree import ParamTree


def _walk(node):
    yield node
    for c in node.children:
        yield from _walk(c)


async def select(pilot, tree: ParamTree, name: str) -> None:
    """Move the tree's cursor to the tensor ``name`` (expanding its parents)."""
    def there() -> bool:
        cur = tree.cursor_node
        if cur is not None and cur.data is not None and cur.data.name == name:
            return True
        node = next((n for n in _walk(tree.root) if n.data is not None and n.data.name == name),
                    None)
        if node is not None:
            p = node.parent
            while p is not None:
                p.expand()
                p = p.parent
            tree.move_cursor(node)
        return False

    await wait_for(pilot, there, tries=200)


@pytest.mark.asyncio
async def test_statistics_follow_the_selection(fixtures_root):
    """Item 1: the panel is titled with its tensor; moving on drops the old numbers."""
    app = make_app(str(fixtures_root / "w3-llama-f32"))
    async with app.run_test(size=(120, 40)) as pilot:
        await inspector_ready(pilot, app)
        screen = app.screen
        tree = screen.query_one("#params", ParamTree)
        box = screen.query_one("#stats")
        await select(pilot, tree, "model.embed_tokens.weight")
        await pilot.press("s")
        await wait_for(pilot, lambda: "mean" in str(box.render()), tries=200)
        assert box.border_title == "statistics of model.embed_tokens.weight"
        await select(pilot, tree, "model.norm.weight")
        await pilot.pause(0.1)
        assert box.border_title == "statistics of model.norm.weight"
        assert "mean" not in str(box.render())
        assert "model.norm.weight" in str(box.render())
        await pilot.press("s")
        await wait_for(pilot, lambda: "mean" in str(box.render()), tries=200)
    from safetensors.torch import load_file

    norm = load_file(fixtures_root / "w3-llama-f32.reference" / "model.safetensors")[
        "model.norm.weight"].double()
    assert f"min {float(norm.min()):.4g}" in str(box.render())


@pytest.mark.asyncio
async def test_browser_marks_every_folder_and_goes_up(fixtures_root, tmp_path):
    """Items 3 and 5: each listed folder is sniffed without the cursor visiting it; a folder
    of step folders names them; Backspace shows the parent."""
    runs = tmp_path / "run"
    runs.mkdir()
    copy_checkpoint(fixtures_root / "w2-qwen2-f32", runs / "global_step_10")
    copy_checkpoint(fixtures_root / "w3-llama-f32", runs / "global_step_20")
    (runs / "logs").mkdir()
    app = make_app(str(runs))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, BrowserScreen))
        screen = app.screen
        s10, s20 = str(runs / "global_step_10"), str(runs / "global_step_20")
        await wait_for(pilot, lambda: s10 in screen.marks and s20 in screen.marks
                       and str(runs) in screen.marks, tries=300)
        assert screen.marks[s10] == "fsdp, 2 rank(s)"
        assert screen.marks[s20] == "fsdp, 3 rank(s)"
        assert screen.marks[str(runs / "logs")] == ""
        screen.highlighted = str(runs)
        screen._show(str(runs))
        text = str(screen.query_one("#detected").render())
        assert "no checkpoint here; checkpoints inside: global_step_10, global_step_20" in text
        await pilot.press("backspace")
        tree = screen.query_one("#tree")
        await wait_for(pilot, lambda: str(tree.path) == str(tmp_path))
        await wait_for(pilot, lambda: str(runs) in [str(c.data.path) for c in tree.root.children
                                                    if c.data is not None])
        assert screen.path == str(tmp_path)


async def open_form(pilot, app, out):
    from shardscope.tui.screens.merge_options import MergeOptionsScreen

    await inspector_ready(pilot, app)
    await pilot.press("m")
    await wait_for(pilot, lambda: isinstance(app.screen, MergeOptionsScreen))
    app.screen.query_one("#output").value = str(out)
    return app.screen


@pytest.mark.asyncio
async def test_failed_merge_shows_whole_error_and_stops(fixtures_root, tmp_path):
    """Item 2: a shard damaged after inspection makes the merge fail in the run screen; the
    bars stop, the message is shown whole, escape goes back."""
    from textual.widgets import ProgressBar

    from shardscope.tui.screens.merge_run import MergeRunScreen

    src = copy_checkpoint(fixtures_root / "w2-qwen2-f32", tmp_path / ("a-folder-name-long-enough-to-wrap-" * 3))
    app = make_app(str(src))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_form(pilot, app, tmp_path / "out")
        shard = src / "model_world_size_2_rank_1.pt"
        shard.write_bytes(shard.read_bytes()[:1000])  # cut after the inspection
        await pilot.click("#ok")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeRunScreen))
        run = app.screen
        await wait_for(pilot, lambda: run.finished, tries=400)
        assert "the merge failed" in str(run.query_one("#status").render())
        result = str(run.query_one("#result").render())
        assert str(shard) in result and "escape: back" in result
        assert all(bar.total is not None for bar in run.query(ProgressBar))
        await pilot.press("escape")
        await inspector_ready(pilot, app)
    assert not (tmp_path / "out").exists()


@pytest.mark.asyncio
async def test_form_refuses_a_checkpoint_with_errors(fixtures_root, tmp_path):
    """Item 2 (better): the form lists the inspection's errors and will not start."""
    from textual.widgets import Button

    src = copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    next(src.glob("*rank_2*")).unlink()
    app = make_app(str(src))
    async with app.run_test(size=(80, 24)) as pilot:
        form = await open_form(pilot, app, tmp_path / "out")
        assert app.screen.ckpt.errors
        text = str(form.query_one("#refusal").render())
        assert "cannot merge" in text and app.screen.ckpt.errors[0].code in text
        assert form.query_one("#ok", Button).disabled
        form.query_one("#output").focus()
        await pilot.press("enter")  # submitting from a field is refused as well
        await pilot.pause(0.1)
        assert form is app.screen and "cannot be merged" in str(form.query_one("#error").render())
    assert not (tmp_path / "out").exists()


@pytest.mark.asyncio
async def test_form_labels_lora_fields_and_speaks_its_own_words(fixtures_root, tmp_path):
    """Item 6: the LoRA inputs are labelled, the heading is whole, errors name the form's
    checkbox and fields, not the command line's flags."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    app = make_app(str(fixtures_root / "w2-lora-qv"))
    async with app.run_test(size=(80, 24)) as pilot:
        form = await open_form(pilot, app, tmp_path / "out")
        heading = str(form.query_one("#lora-heading").render())
        assert heading.endswith(form.ckpt.lora.summary())
        labels = [str(w.render()) for w in form.query("#lora-row Label")]
        assert labels == ["adapter", "lora_alpha (the run's value)"]
        form.query_one("#output").focus()
        await pilot.press("enter")
        await pilot.pause(0.1)
        err = str(form.query_one("#error").render())
        assert "tick “overwrite an existing output”" in err and "--" not in err
        form.query_one("#lora-alpha").value = "0"
        form.query_one("#overwrite").value = True
        await pilot.press("enter")
        await pilot.pause(0.1)
        err = str(form.query_one("#error").render())
        assert "lora_alpha must be positive" in err and "--" not in err
        assert form.query_one("#ok").region.bottom <= 24  # the buttons are on the screen


def test_help_lists_every_binding():
    """Item 7: every key a screen binds is in the help, and tab, space, s, n are explained."""
    from shardscope.tui.screens.browser import BrowserScreen
    from shardscope.tui.screens.compare import CompareScreen
    from shardscope.tui.screens.help import KEYS
    from shardscope.tui.screens.merge_run import MergeRunScreen

    listed = {k.strip() for _, rows in KEYS for keys, _ in rows for k in keys.split(",")}
    names = {"slash": "/", "question_mark": "?"}
    for screen in (BrowserScreen, InspectorScreen, MergeRunScreen, CompareScreen):
        for b in screen.BINDINGS:
            for key in b.key.split(","):
                assert names.get(key, key) in listed, (screen.__name__, key)
    assert {"tab", "space", "s", "n", "v", "backspace"} <= listed


@pytest.mark.asyncio
async def test_help_fits_80x24(fixtures_root):
    """Item 7: at 80x24 the help is inside the screen and scrolls to its last line."""
    app = make_app(str(fixtures_root / "w2-qwen2-f32"))
    async with app.run_test(size=(80, 24)) as pilot:
        await inspector_ready(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause(0.2)
        box = app.screen.query_one("#help")
        assert box.region.right <= 80 and box.region.bottom <= 24
        await pilot.press("end")
        await pilot.pause(0.2)
        assert box.scroll_y == box.max_scroll_y > 0


def test_summary_labels_never_touch_their_values(megatron_root):
    """Item 8: on a Megatron layout (the longest labels: "tied embeddings", "virtual
    stages"...), every label is followed by at least two spaces before its value."""
    pytest.importorskip("megatron.core")
    from rich.text import Text

    from shardscope.core import detect
    from shardscope.tui.widgets.layout_summary import summary_text

    layout = detect(str(megatron_root / "llama" / "tp2_pp2" / "legacy"))
    labels = ["format", "world size", "device mesh", "tensors", "config", *layout.details]
    lines = Text.from_markup(summary_text(layout)).plain.splitlines()
    assert "tied embeddings" in layout.details
    for label in labels:
        line = next(line for line in lines if line.startswith(label + " "))
        assert line.startswith(label + "  "), line
