"""Progressive loading: the inspector opens on what the first rank file says, in a loading
state (progress bar, problems as they are found, merge refused), and takes the full layout
when every rank file is read. The reader is made to wait, deterministically, before a chosen
rank file (the real reader, on real FSDP2 rank files: only the moment it reads is held)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from conftest import copy_checkpoint, inspector_ready, wait_for
from shardscope.core import ReadCancelled, detect
from shardscope.core.formats import fsdp
from shardscope.tui.app import make_app
from shardscope.tui.screens.browser import BrowserScreen
from shardscope.tui.screens.inspector import InspectorScreen
from shardscope.tui.screens.merge_options import MergeOptionsScreen
from shardscope.tui.widgets.param_tree import ParamTree
from test_app import leaves, open_form, run_to_end
from test_merge_exact import assert_bit_equal, load

NAME = "model.layers.0.self_attn.q_proj.weight"


class Gate:
    """Holds fsdp's reader before it parses ``rank_{hold}`` until :meth:`open`; records the
    rank files parsed, and (``stopped``) when the reader stopped on a cancel."""

    def __init__(self, monkeypatch, hold: int):
        self.event = threading.Event()
        self.stopped = threading.Event()
        self.read: list[str] = []
        self.by_thread: list[tuple[int, str]] = []
        self.stopped_thread: int | None = None
        real = fsdp.read_torch_archive
        real_progressed = fsdp.progressed

        def progressed(*a, **kw):
            try:
                return real_progressed(*a, **kw)
            except ReadCancelled:
                self.stopped_thread = threading.get_ident()
                self.stopped.set()
                raise

        monkeypatch.setattr(fsdp, "progressed", progressed)
        suffix = f"_rank_{hold}.pt"

        def read(path, *a, **kw):
            if str(path).endswith(suffix):
                assert self.event.wait(60), "the test never opened the gate"
            self.read.append(os.path.basename(path))
            self.by_thread.append((threading.get_ident(), os.path.basename(path)))
            return real(path, *a, **kw)

        monkeypatch.setattr(fsdp, "read_torch_archive", read)

    def open(self) -> None:
        self.event.set()


def text(widget) -> str:
    return str(widget.render())


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


async def loading_inspector(pilot, app) -> InspectorScreen:
    await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen)
                   and app.screen.is_mounted and app.screen.loading_path is not None,
                   tries=400)
    return app.screen


async def select(pilot, tree: ParamTree, name: str) -> None:
    node = tree.find(name)
    assert node is not None, name
    tree.reveal(node)
    await pilot.pause(0.05)
    assert tree.cursor_node is node


@pytest.mark.asyncio
async def test_preview_then_full_layout(fixtures_root, tmp_path, monkeypatch):
    src = fixtures_root / "w4-fsdp2"
    full = detect(src)
    gate = Gate(monkeypatch, hold=2)
    app = make_app(str(src))
    app.PREVIEW_AFTER = 0  # tiny files read at once: preview whatever the pace
    async with app.run_test(size=(110, 34)) as pilot:
        screen = await loading_inspector(pilot, app)
        # the preview: every tensor with its global shape, a bar counting rank files
        tree = screen.query_one("#params", ParamTree)
        assert sorted(leaves(tree)) == sorted(full.tensors)
        assert screen.ckpt.tensors[NAME].shape == full.tensors[NAME].shape
        assert screen.ckpt.world_size == 4 and screen.ckpt.parallel == full.parallel
        bar = screen.query_one("#loading-bar")
        assert bar.total == 4 and 1 <= bar.progress <= 2
        assert "reading rank files" in text(screen.query_one("#loading-text"))
        assert "problems (0 so far)" in str(
            screen.query_one("#files-problems").get_tab("tab-problems").label)
        await select(pilot, tree, NAME)
        pieces = screen.query_one("#pieces")
        await wait_for(pilot, lambda: pieces.row_count >= 1)  # the highlight's message, in turn
        assert 1 <= pieces.row_count <= 2 and "pieces read so far" in str(pieces.border_title)
        # what needs every file is refused, saying why; no architecture check yet
        await pilot.press("m")
        await pilot.pause(0.1)
        assert app.screen is screen
        assert any("merge needs every file: still reading rank files" in n
                   for n in notices(app))
        await pilot.press("s")
        await pilot.pause(0.05)
        assert any(n.startswith("statistics needs every file") for n in notices(app))
        assert screen.verdict is None and not [w for w in app.workers if w.group == "check"]
        assert gate.read == ["model_world_size_4_rank_0.pt", "model_world_size_4_rank_1.pt"]

        gate.open()
        assert await inspector_ready(pilot, app) is screen  # the same screen, now loaded
        assert not screen.query("#loading")
        assert len(screen.ckpt.files) == 4 and screen.ckpt.problems == []
        assert tree is not screen.query_one("#params")
        assert screen.selected_tensor().name == NAME  # the cursor stayed on the tensor
        assert screen.query_one("#pieces").row_count == len(full.tensors[NAME].pieces) == 4
        assert "no problems found" in text(screen.query_one("#problems"))
        await wait_for(pilot, lambda: screen.verdict is not None, tries=1200)
        form = await open_form(pilot, app, tmp_path / "out")
        assert isinstance(form, MergeOptionsScreen)
        await run_to_end(pilot, app)
    assert_bit_equal(load(tmp_path / "out"), load(fixtures_root / "w4-fsdp2.reference"))


@pytest.mark.asyncio
async def test_problems_found_after_the_preview_show_while_loading(fixtures_root, tmp_path,
                                                                    monkeypatch):
    src = copy_checkpoint(fixtures_root / "w4-fsdp2", tmp_path / "ckpt")
    damaged = src / "model_world_size_4_rank_2.pt"
    os.truncate(damaged, damaged.stat().st_size // 2)
    gate = Gate(monkeypatch, hold=3)
    app = make_app(str(src))
    app.PREVIEW_AFTER = 0
    async with app.run_test(size=(110, 34)) as pilot:
        screen = await loading_inspector(pilot, app)
        problems = screen.query_one("#problems")
        # rank 2's truncation shows while rank 3 is still to be read
        await wait_for(pilot, lambda: damaged.name in text(problems), tries=400)
        assert "1 problem(s) so far" in text(problems)
        assert "truncated-file" in text(problems)
        assert "problems (1 so far)" in str(
            screen.query_one("#files-problems").get_tab("tab-problems").label)
        assert screen.loading_path is not None and "model_world_size_4_rank_3.pt" not in gate.read
        gate.open()
        await inspector_ready(pilot, app)
        assert [p.code for p in screen.ckpt.problems][:1] == ["truncated-file"]
        assert screen.query_one("#files-problems").active == "tab-problems"
        assert "no problems" not in text(screen.query_one("#problems"))


@pytest.mark.asyncio
async def test_escape_while_loading_cancels_the_read(fixtures_root, tmp_path, monkeypatch):
    """Opened from the browser; escape goes back to it and the reader stops at its next
    file (rank 3 is never read); nothing opens later."""
    parent = tmp_path / "runs"
    parent.mkdir()
    src = copy_checkpoint(fixtures_root / "w4-fsdp2", parent / "ckpt")
    gate = Gate(monkeypatch, hold=2)
    app = make_app(str(parent))
    app.PREVIEW_AFTER = 0
    async with app.run_test(size=(110, 34)) as pilot:
        browser = app.screen
        assert isinstance(browser, BrowserScreen)
        browser.highlighted = str(src)
        await pilot.press("o")
        await loading_inspector(pilot, app)
        await pilot.press("escape")
        await pilot.pause(0.05)
        assert app.screen is browser and app.loading_path() is None
        gate.open()
        await wait_for(pilot, gate.stopped.is_set, tries=400)
        await pilot.pause(0.2)
        assert app.screen is browser
        # the app's reader (not the browser's own sniff of the folder) stopped before rank 3
        assert [n for t, n in gate.by_thread if t == gate.stopped_thread] == [
            f"model_world_size_4_rank_{r}.pt" for r in range(3)]
        assert not any(isinstance(s, InspectorScreen) for s in app.screen_stack)
        # the browser marks the folder by its own read once the app's was cancelled
        await pilot.press("o")
        await inspector_ready(pilot, app)
        assert len(app.screen.ckpt.files) == 4


@pytest.mark.asyncio
async def test_failure_after_the_preview_shows_on_the_screen(fixtures_root, tmp_path,
                                                              monkeypatch):
    """A rank file that is a symbolic link out of the checkpoint is read (the preview opens
    on rank 0) but refused once the whole layout is known: the loading screen says so and
    keeps refusing a merge."""
    src = copy_checkpoint(fixtures_root / "w4-fsdp2", tmp_path / "ckpt")
    outside = tmp_path / "elsewhere.pt"
    shutil.move(src / "model_world_size_4_rank_3.pt", outside)
    os.symlink(outside, src / "model_world_size_4_rank_3.pt")
    gate = Gate(monkeypatch, hold=2)
    app = make_app(str(src))
    app.PREVIEW_AFTER = 0
    async with app.run_test(size=(110, 34)) as pilot:
        screen = await loading_inspector(pilot, app)
        gate.open()
        await wait_for(pilot, lambda: screen.failed is not None, tries=400)
        assert app.screen is screen
        line = text(screen.query_one("#loading-text"))
        assert line.startswith("reading failed:") and "outside" in line
        assert not screen.query_one("#loading-bar").display
        assert "reading failed" in text(screen.query_one("#problems"))
        await pilot.press("m")
        await pilot.pause(0.1)
        assert app.screen is screen
        assert any(n.startswith("merge: reading the checkpoint failed") for n in notices(app))


def test_watch_reports_preview_counts_copies_and_cancels(fixtures_root, tmp_path):
    """core/phases.py without the app: one preview (after rank 0, with the mesh and every
    tensor's global shape), counts up to the total, problems as copies taken when sent, and
    a cancel that stops detect between files."""
    from shardscope.core.phases import watching

    src = copy_checkpoint(fixtures_root / "w4-fsdp2", tmp_path / "ckpt")
    damaged = src / "model_world_size_4_rank_1.pt"
    os.truncate(damaged, damaged.stat().st_size // 2)
    seen = []
    with watching(seen.append, threading.Event(), interval=60, preview_after=0):
        full = detect(src)
    previews = [p for p in seen if p.preview is not None]
    assert len(previews) == 1 and previews[0].done == 1 and previews[0].total == 4
    preview = previews[0].preview
    assert sorted(preview.tensors) == sorted(full.tensors)
    assert preview.tensors[NAME].shape == full.tensors[NAME].shape
    assert preview.mesh_shape == full.mesh_shape and preview.parallel == full.parallel
    assert preview.config_dir == full.config_dir and preview.files[0].rank == 0
    assert [len(t.pieces) for t in preview.tensors.values()] == [1] * len(preview.tensors)
    # throttled to one update a minute: the start, the preview, the new problem (rank 1),
    # the last file
    assert [(p.done, len(p.problems)) for p in seen] == [(0, 0), (1, 0), (2, 1), (4, 1)]
    assert seen[2].problems[0].code == "truncated-file"
    assert seen[2].problems[0] is not full.problems[0]  # a copy, not the reader's object
    assert full.tensors[NAME].pieces[0] is not preview.tensors[NAME].pieces[0]
    cancel = threading.Event()

    def stop(p):
        if p.done == 2:
            cancel.set()

    with watching(stop, cancel, interval=0):
        with pytest.raises(ReadCancelled):
            detect(src)


@pytest.mark.asyncio
async def test_full_layout_arriving_before_the_preview_is_mounted(fixtures_root):
    """The full layout may arrive while the preview's screen is pushed but not mounted yet:
    the screen takes it once mounted (no half screen, no error)."""
    from shardscope.core.phases import ReadProgress

    full = detect(fixtures_root / "w4-fsdp2")
    app = make_app(str(fixtures_root))
    async with app.run_test(size=(110, 34)) as pilot:
        screen = InspectorScreen(full, loading=(full.path, ReadProgress(1, 4)))
        await screen.show_loaded(full)  # before it is mounted
        app.push_screen(screen)
        await inspector_ready(pilot, app)
        assert not screen.query("#loading") and len(screen.ckpt.files) == 4
