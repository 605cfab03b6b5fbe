"""The first screen's savings. The parameter tree built lazily (a group's children added when it is first expanded) shows
the same tree as the one built whole: same nodes, labels, order and open groups, the same
filter, rank order, find/reveal and first leaf. Layout read from the real w4-fsdp2 fixture
(torch.distributed gloo run); the lazy tree is forced with ``LAZY_AT = 0``, closed groups with ``OPEN_BELOW = 0``.
Started on a checkpoint, the app mounts the browser only when the user goes back to it."""

from __future__ import annotations

import pytest
from textual.app import App

from shardscope.core import detect
from shardscope.tui.widgets.param_tree import ParamTree
from tests.conftest import wait_for


def shape(node, depth=0, out=None) -> list:
    """Every built node under ``node``: (depth, label, tensor name, open)."""
    out = [] if out is None else out
    out.append((depth, str(node.label), getattr(node.data, "name", None), node.is_expanded))
    for c in node.children:
        shape(c, depth + 1, out)
    return out


class Trees(App):
    def __init__(self, tensors):
        super().__init__()
        self.tensors = tensors

    def compose(self):
        eager = ParamTree(self.tensors, id="eager")
        eager.LAZY_AT = 10 ** 9
        lazy = ParamTree(self.tensors, id="lazy")
        lazy.LAZY_AT = 0
        for tree in (eager, lazy):  # groups closed at first, as in a big model's tree
            tree.OPEN_BELOW = 0
        yield eager
        yield lazy


@pytest.mark.asyncio
async def test_lazy_tree_is_the_eager_tree(fixtures_root):
    tensors = detect(fixtures_root / "w4-fsdp2").tensors
    names = list(tensors)
    app = Trees(tensors)
    async with app.run_test(size=(100, 40)) as pilot:
        eager = app.query_one("#eager", ParamTree)
        lazy = app.query_one("#lazy", ParamTree)
        await wait_for(pilot, lambda: eager.root.children and lazy.root.children)
        # at first the lazy tree holds only what is open: fewer nodes, no leaf
        assert len(lazy._tree_nodes) < len(eager._tree_nodes)
        assert lazy._leaf == {} and len(eager._leaf) == len(names)
        # what is shown is the same
        assert [(d, lab, n, o) for d, lab, n, o in shape(lazy.root) if d <= 1] == \
            [(d, lab, n, o) for d, lab, n, o in shape(eager.root) if d <= 1]
        # leaves in display order, first leaf, find: the same, and building does not open
        assert [n.data.name for n in lazy.leaves()] == [n.data.name for n in eager.leaves()]
        assert sorted(n.data.name for n in lazy.leaves()) == sorted(names)
        lazy.rebuild()
        assert lazy.first_leaf().data.name == eager.first_leaf().data.name
        lazy.rebuild()
        name = names[len(names) // 2]
        node = lazy.find(name)
        assert node is not None and node.data.name == name and not node.parent.is_expanded
        assert lazy.find("no.such.tensor") is None
        lazy.reveal(node)
        await pilot.pause(0.05)
        assert lazy.cursor_node is node
        # expanding everything gives the eager tree, node for node
        lazy.rebuild()
        eager.rebuild()
        lazy.root.expand_all()
        eager.root.expand_all()
        assert shape(lazy.root) == shape(eager.root)
        # a filter (opens every match) and a rank order (largest first, its top block open)
        for tree in (eager, lazy):
            tree.set_filter("weight")
        assert shape(lazy.root) == shape(eager.root)
        assert len(lazy.leaves()) == len([n for n in names if "weight" in n]) > 0
        for tree in (eager, lazy):
            tree.set_filter("")
            tree.set_rank(lambda t: t.numel)
        assert [n.data.name for n in lazy.leaves()] == [n.data.name for n in eager.leaves()]
        assert [s for s in shape(lazy.root) if s[3]] == [s for s in shape(eager.root) if s[3]]
        # the user opening a closed group with the keyboard sees its children
        lazy.set_rank(None)
        lazy.focus()
        lazy.move_cursor(lazy.root.children[0])
        await pilot.pause(0.05)
        group = lazy.cursor_node
        assert group.data is None and not group.children and not group.is_expanded
        await pilot.press("space")
        await wait_for(pilot, lambda: group.is_expanded and group.children)


@pytest.mark.asyncio
async def test_started_on_a_checkpoint_the_browser_comes_on_escape(fixtures_root, monkeypatch):
    """Started on a checkpoint, the app mounts no browser before the inspector; escape then
    opens the browser on that folder, marked from the app's read (not read a second time)."""
    from shardscope.tui.app import make_app
    from shardscope.tui.screens.browser import BrowserScreen
    from shardscope.tui.screens.inspector import InspectorScreen
    from tests.conftest import inspector_ready

    src = fixtures_root / "w4-fsdp2"
    reads = []
    app = make_app(str(src))
    async with app.run_test(size=(110, 34)) as pilot:
        await inspector_ready(pilot, app)
        assert not any(isinstance(s, BrowserScreen) for s in app.screen_stack)
        import shardscope.core as core
        monkeypatch.setattr(core, "detect", lambda *a, **k: reads.append(a) or 1 / 0)
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, BrowserScreen))
        browser = app.screen
        assert browser.path == str(src)
        assert not any(isinstance(s, InspectorScreen) for s in app.screen_stack)
        assert browser.marks[str(src)] == "fsdp, 4 rank(s)"
        await pilot.pause(0.3)
        assert str(src) not in browser.pending and reads == []
        assert "fsdp, 4 rank(s)" in str(browser.query_one("#detected").render())
        # and opening it again from there works
        monkeypatch.undo()
        await pilot.press("o")
        await inspector_ready(pilot, app)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is browser)


@pytest.mark.asyncio
async def test_progress_before_the_loading_screen_is_composed(fixtures_root):
    """The reader waits at most 3 s for the preview's first paint, then goes on: its next
    progress report (or its failure) may reach the pushed inspector before it is composed.
    Kept, and shown once it is (seen once under load: NoMatches '#loading-text')."""
    from textual.widgets import Label, ProgressBar

    from shardscope.core.phases import ReadProgress
    from shardscope.tui.screens.inspector import InspectorScreen

    src = fixtures_root / "w4-fsdp2"
    layout = detect(src)
    screen = InspectorScreen(layout, loading=(str(src), ReadProgress(1, 4, preview=layout)))
    screen.show_progress(ReadProgress(3, 4))  # not composed: no widget to update yet
    app = App()
    async with app.run_test(size=(110, 34)) as pilot:
        await app.push_screen(screen)
        await wait_for(pilot, lambda: screen.is_mounted)
        assert screen.query_one("#loading-bar", ProgressBar).progress == 3
        assert "3/4" in str(screen.query_one("#loading-text", Label).render())
        failing = InspectorScreen(layout, loading=(str(src), ReadProgress(1, 4, preview=layout)))
        failing.show_failed("rank 3: truncated")
        await app.push_screen(failing)
        await wait_for(pilot, lambda: failing.is_mounted and failing.failed is not None)
        await pilot.pause(0.05)
        assert "reading failed: rank 3: truncated" in \
            str(failing.query_one("#loading-text", Label).render())
