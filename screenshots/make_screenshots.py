"""Render each screen of the real app on the real sample checkpoint: SVG (Textual) and PNG
(cairosvg, no browser). Run: ``python screenshots/make_screenshots.py`` (needs the dev extra).
Writes the sample to a temporary folder with ``shardscope sample``'s writer (torch.distributed,
gloo, CPU), and a Megatron TP=2 x PP=2 checkpoint with megatron-core."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this checkout's core/ and tui/ as shardscope.core/.tui (tests/shim/shardscope/__init__.py)
sys.path.insert(0, str(HERE.parent / "tests" / "shim"))

from shardscope.core.sample import write_sample  # noqa: E402
from shardscope.tui.app import make_app  # noqa: E402
from shardscope.tui.screens.inspector import InspectorScreen  # noqa: E402
from shardscope.tui.screens.merge_options import MergeOptionsScreen  # noqa: E402
from shardscope.tui.screens.merge_run import MergeRunScreen  # noqa: E402

SIZE = (110, 34)


async def wait_for(pilot, cond, tries=200):
    for _ in range(tries):
        if cond():
            return
        await pilot.pause(0.05)
    raise RuntimeError("screen did not reach the expected state")


def _walk(node):
    yield node
    for c in node.children:
        yield from _walk(c)


def save(app, name: str) -> None:
    svg = HERE / f"{name}.svg"
    app.save_screenshot(str(svg))
    try:
        import cairosvg

        cairosvg.svg2png(url=str(svg), write_to=str(HERE / f"{name}.png"))
    except ImportError:
        print("cairosvg not installed: SVG only", file=sys.stderr)
    print(f"wrote screenshots/{name}.svg")


async def shoot(ckpt: Path, out: Path) -> None:
    app = make_app(str(ckpt))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen)
                       and app.screen.loading_path is None)
        await pilot.press("down", "down", "down", "down")
        await pilot.pause(0.2)
        save(app, "inspector")
        await pilot.press("slash", *"q_proj")
        await pilot.pause(0.3)
        await pilot.press("enter")
        tree = app.screen.query_one("#params")
        leaf = next(n for n in _walk(tree.root) if n.data is not None and
                    n.data.name.endswith("q_proj.weight"))
        tree.move_cursor(leaf)
        await pilot.pause(0.3)
        save(app, "inspector-filter")
        await pilot.press("v")  # the sharding map of the selected q_proj
        await pilot.pause(0.3)
        save(app, "inspector-map")
        await pilot.press("m")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeOptionsScreen))
        app.screen.query_one("#output").value = str(out)
        await pilot.pause(0.2)
        save(app, "merge-options")
        await pilot.click("#ok")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeRunScreen)
                       and app.screen.finished)
        await pilot.pause(0.3)
        save(app, "merge-done")


async def shoot_megatron(ckpt: Path) -> None:
    """The inspector on a legacy Megatron TP=2 x PP=2 checkpoint, the tree grouped by the
    Megatron names (``n``), a q_proj selected: its pieces come from the two TP ranks."""
    app = make_app(str(ckpt))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen)
                       and app.screen.loading_path is None)
        await pilot.press("n")
        tree = app.screen.query_one("#params")
        await pilot.pause(0.3)
        leaf = next(n for n in _walk(tree.root) if n.data is not None and
                    n.data.name == "model.layers.2.self_attn.q_proj.weight")
        n = leaf.parent
        while n is not None:
            n.expand()
            n = n.parent
        await pilot.pause(0.3)
        tree.move_cursor(leaf)
        await pilot.pause(0.3)
        save(app, "megatron-inspector")


async def shoot_small(ckpt: Path) -> None:
    """The inspector at 80x24, the smallest size the app is laid out for."""
    app = make_app(str(ckpt))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen)
                       and app.screen.loading_path is None)
        tree = app.screen.query_one("#params")
        leaf = next(n for n in _walk(tree.root) if n.data is not None and
                    n.data.name == "model.embed_tokens.weight")
        tree.move_cursor(leaf)
        await pilot.press("v")
        await pilot.pause(0.3)
        save(app, "inspector-80x24")


async def shoot_compare(ckpt: Path, other: Path) -> None:
    """The compare view (``c``): the sharded run against a copy of it fine-tuned for two AdamW
    steps with its embedding, layer 0 and final norm frozen, sorted by change, with the
    per-layer chart of relative change."""
    from shardscope.tui.screens.compare import ComparePathScreen, CompareScreen

    app = make_app(str(ckpt))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen)
                       and app.screen.loading_path is None
                       and app.screen.is_mounted)
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, ComparePathScreen)
                       and app.screen.is_mounted)
        app.screen.query_one("#compare-path").value = ""
        await pilot.press(*str(other), "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen)
                       and app.screen.is_mounted and app.screen.finished
                       and app.screen.landed, tries=2400)
        await pilot.pause(0.3)
        save(app, "compare")


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="shardscope-shots-"))
    try:
        write_sample(tmp / "global_step_100" / "actor", world_size=4)
        asyncio.run(shoot(tmp / "global_step_100" / "actor", tmp / "merged_hf"))
        asyncio.run(shoot_small(tmp / "global_step_100" / "actor"))
        sys.path.insert(0, str(HERE.parent / "tests"))
        from fixtures_diff import write_training_steps  # real AdamW steps, frozen layers

        write_training_steps(tmp / "merged_hf", tmp / "finetuned")
        asyncio.run(shoot_compare(tmp / "global_step_100" / "actor", tmp / "finetuned" / "step2"))
        try:
            from shardscope.core.sample_megatron import write_megatron

            write_megatron(tmp / "megatron", "llama", [(2, 2, 0, 1, False)])
        except ImportError:
            print("megatron-core not installed: no Megatron screenshot", file=sys.stderr)
        else:
            asyncio.run(shoot_megatron(tmp / "megatron" / "tp2_pp2" / "legacy"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
