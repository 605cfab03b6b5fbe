"""Pilot tests of the real app on real checkpoints."""

from __future__ import annotations

import threading

import pytest

from conftest import inspector_ready, wait_for
from shardscope.core.execute import _Writer
from test_merge_exact import assert_bit_equal, load
from shardscope.tui.app import make_app
from shardscope.tui.screens.merge_options import MergeOptionsScreen
from shardscope.tui.screens.merge_run import MergeRunScreen
from shardscope.tui.widgets.param_tree import ParamTree


def leaves(tree: ParamTree) -> list[str]:
    out, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        if n.data is not None:
            out.append(n.data.name)
        stack.extend(n.children)
    return out


def nodes(tree: ParamTree) -> list:
    out, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out


async def open_inspector(pilot, app):
    await inspector_ready(pilot, app)
    return app.screen


async def open_form(pilot, app, out) -> MergeOptionsScreen:
    """From the inspector, open the merge form and set its output folder."""
    await pilot.press("m")
    # pushed is not composed: on a loaded machine #output may not exist yet
    await wait_for(pilot, lambda: isinstance(app.screen, MergeOptionsScreen)
                   and bool(app.screen.query("#output")))
    app.screen.query_one("#output").value = str(out)
    return app.screen


async def refused(pilot, form, field: str, value: str, message: str) -> None:
    """Set a bad ``value`` in ``field``, submit, and check the form refuses with ``message``."""
    form.query_one(field).value = value
    await pilot.click("#ok")
    await pilot.pause(0.1)
    assert isinstance(form.app.screen, MergeOptionsScreen)
    assert message in str(form.query_one("#error").render())


async def run_to_end(pilot, app, tries=400) -> MergeRunScreen:
    """Submit the form and wait for the merge run to finish."""
    await pilot.pause(0.1)  # the form laid out after its last change (#ok may have moved)
    await pilot.click("#ok")
    await wait_for(pilot, lambda: isinstance(app.screen, MergeRunScreen))
    run = app.screen
    await wait_for(pilot, lambda: run.finished, tries=tries)
    return run


@pytest.mark.asyncio
async def test_open_filter_and_merge_bit_exact(fixtures_root, tmp_path):
    src = fixtures_root / "w4-hsdp"
    app = make_app(str(src))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_inspector(pilot, app)
        summary = str(screen.query_one("#summary").render())
        assert "fsdp" in summary and "ddp=2 x fsdp=2" in summary
        tree = screen.query_one("#params", ParamTree)
        await wait_for(pilot, lambda: len(leaves(tree)) == 27)
        await pilot.press("slash", *"qproj")
        await wait_for(pilot, lambda: len(leaves(tree)) == 4)
        assert all("q_proj" in n for n in leaves(tree))
        await pilot.press("enter")
        await open_form(pilot, app, tmp_path / "out")
        run = await run_to_end(pilot, app)
        assert "verified" in str(run.query_one("#result").render())
    assert_bit_equal(load(tmp_path / "out"), load(fixtures_root / "w4-hsdp.reference"))


@pytest.mark.asyncio
async def test_options_refuse_existing_output(fixtures_root, tmp_path):
    (tmp_path / "exists").mkdir()
    app = make_app(str(fixtures_root / "w2-qwen2-f32"))
    async with app.run_test(size=(120, 40)) as pilot:
        await open_inspector(pilot, app)
        form = await open_form(pilot, app, tmp_path / "exists")
        await refused(pilot, form, "#output", str(tmp_path / "exists"), "exists")


@pytest.mark.asyncio
async def test_cancel_midway_leaves_nothing(fixtures_root, tmp_path, monkeypatch):
    gate, started = threading.Event(), threading.Event()
    real = _Writer.write_tensor

    def gated(self, t, *a):
        started.set()
        gate.wait(10)  # hold the merge mid-way until the test has pressed escape
        return real(self, t, *a)

    monkeypatch.setattr(_Writer, "write_tensor", gated)
    out = tmp_path / "out"
    app = make_app(str(fixtures_root / "w3-llama-f32"))
    async with app.run_test(size=(120, 40)) as pilot:
        await open_inspector(pilot, app)
        await open_form(pilot, app, out)
        await pilot.click("#ok")
        await wait_for(pilot, started.is_set)
        run = app.screen
        await pilot.press("escape")
        gate.set()
        await wait_for(pilot, lambda: run.finished, tries=400)
        assert "cancelled" in str(run.query_one("#status").render())
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.asyncio
async def test_statistics_of_a_sharded_tensor(fixtures_root):
    from safetensors.torch import load_file

    app = make_app(str(fixtures_root / "w3-llama-f32"))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_inspector(pilot, app)
        tree = screen.query_one("#params", ParamTree)

        def find():
            return next((n for n in _walk(tree.root)
                         if n.data is not None and n.data.name == "model.embed_tokens.weight"),
                        None)

        def on_embedding() -> bool:
            cur = tree.cursor_node
            if cur is not None and cur.data is not None and \
                    cur.data.name == "model.embed_tokens.weight":
                return True
            if find() is not None:
                tree.move_cursor(find())  # again, if the tree was rebuilt meanwhile
            return False

        await wait_for(pilot, on_embedding)
        await pilot.press("s")
        await wait_for(pilot, lambda: "mean" in str(screen.query_one("#stats").render()),
                       tries=200)
        text = str(screen.query_one("#stats").render())
    ref = load_file(fixtures_root / "w3-llama-f32.reference" / "model.safetensors")
    emb = ref["model.embed_tokens.weight"].double()
    assert f"min {float(emb.min()):.4g}" in text and f"max {float(emb.max()):.4g}" in text
    assert "NaN 0" in text


@pytest.mark.asyncio
async def test_browser_marks_checkpoints(fixtures_root):
    from shardscope.tui.screens.browser import BrowserScreen

    app = make_app(str(fixtures_root))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, BrowserScreen))
        screen = app.screen
        screen.sniff(str(fixtures_root / "w4-hsdp"))
        await wait_for(pilot, lambda: str(fixtures_root / "w4-hsdp") in screen.marks)
        assert screen.marks[str(fixtures_root / "w4-hsdp")] == "fsdp, 4 rank(s)"
        screen.highlighted = str(fixtures_root / "w2-dcp")
        await pilot.press("o")
        await open_inspector(pilot, app)
        assert "dcp" in str(app.screen.query_one("#summary").render())


def _walk(node):
    yield node
    for c in node.children:
        yield from _walk(c)


@pytest.mark.asyncio
async def test_lora_summary_and_fold_from_the_form(fixtures_root, tmp_path):
    from safetensors.torch import load_file

    from test_lora import exact

    app = make_app(str(fixtures_root / "w2-lora-qv"))
    async with app.run_test(size=(120, 45)) as pilot:
        screen = await open_inspector(pilot, app)
        assert "r=8, alpha=16 on q_proj r=8 scale=2, v_proj r=8 scale=2" in str(screen.query_one("#summary").render())
        form = await open_form(pilot, app, tmp_path / "out")
        await refused(pilot, form, "#lora-alpha", "-3", "lora_alpha must be positive")
        form.query_one("#lora-alpha").value = "16"
        await run_to_end(pilot, app)
    exact(load_file(tmp_path / "out" / "model.safetensors"),
          load_file(fixtures_root / "w2-lora-qv.fold" / "model.safetensors"))


@pytest.mark.asyncio
async def test_merge_form_uploads_after_verification(fixtures_root, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from fake_hub import FakeHub

    with FakeHub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_app_test_token")
        app = make_app(str(fixtures_root / "w2-qwen2-f32"))
        async with app.run_test(size=(120, 50)) as pilot:
            await open_inspector(pilot, app)
            form = await open_form(pilot, app, tmp_path / "out")
            await refused(pilot, form, "#hf-upload", "bad repo id", "not a repository id")
            form.query_one("#hf-upload").value = "me/from-the-app"
            run = await run_to_end(pilot, app, tries=600)
            assert "uploaded to" in str(run.query_one("#result").render())
    [commit] = hub.commits
    assert commit["repo"] == "me/from-the-app"
    assert commit["files"]["model.safetensors"] == (tmp_path / "out" / "model.safetensors").read_bytes()


@pytest.mark.asyncio
async def test_upload_progress_bar_reaches_the_total(fixtures_root, tmp_path, monkeypatch):
    import huggingface_hub.constants
    from textual.widgets import ProgressBar

    from shardscope.core.publish import upload_files
    from fake_hub import FakeHub
    from shardscope.tui.format import human_bytes

    calls = []
    real = MergeRunScreen.on_upload_progress

    def recorded(self, done, total):
        calls.append((done, total))
        real(self, done, total)

    monkeypatch.setattr(MergeRunScreen, "on_upload_progress", recorded)
    with FakeHub(lfs=True) as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("HF_TOKEN", "hf_app_test_token")
        app = make_app(str(fixtures_root / "w2-qwen2-f32"))
        async with app.run_test(size=(120, 50)) as pilot:
            await open_inspector(pilot, app)
            form = await open_form(pilot, app, tmp_path / "out")
            form.query_one("#hf-upload").value = "me/with-a-bar"
            run = await run_to_end(pilot, app, tries=600)
            bar = run.query_one("#upload", ProgressBar)
            label = str(run.query_one("#upload-label").render())
            assert bar.display and run.query_one("#upload-label").display
            total = sum(p.stat().st_size for _, p in upload_files(str(tmp_path / "out")))
            assert (bar.total, bar.progress) == (total, total)
            assert "uploaded to" in str(run.query_one("#result").render())
    weights = (tmp_path / "out" / "model.safetensors").stat().st_size
    assert calls == [(0, total), (weights, total), (total, total)]  # the weights, then the rest
    assert hub.puts and hub.commits[-1]["files"]["model.safetensors"] == \
        (tmp_path / "out" / "model.safetensors").read_bytes()
    assert label == f"uploaded {human_bytes(total)} of {human_bytes(total)}"


@pytest.mark.asyncio
async def test_megatron_inspector_and_merge(megatron_root, tmp_path):
    """A legacy Megatron TP=2 x PP=2 checkpoint: the summary shows the stages and the vocabulary,
    `n` groups the tree by Megatron names, a q_proj comes from two TP ranks, and the merge with
    the reference's config is bit-exact."""
    pytest.importorskip("megatron.core")
    src = megatron_root / "llama" / "tp2_pp2" / "legacy"
    app = make_app(str(src))
    async with app.run_test(size=(140, 45)) as pilot:
        screen = await open_inspector(pilot, app)
        summary = str(screen.query_one("#summary").render())
        assert "stage 0: layers 0-1; stage 1: layers 2-3" in summary
        assert "derived from args" in summary
        tree = screen.query_one("#params", ParamTree)
        await wait_for(pilot, lambda: len(leaves(tree)) == 39)
        await pilot.press("n")
        await wait_for(pilot, lambda: tree.by_source)
        assert [str(c.label) for c in tree.root.children][:2] == ["decoder", "embedding"]
        node = next(n for n in nodes(tree)
                    if n.data is not None
                    and n.data.name == "model.layers.3.self_attn.q_proj.weight")
        path, n = [], node.parent
        while n is not None and n is not tree.root:
            path.insert(0, str(n.label))
            n = n.parent
        assert path == ["decoder", "layers.0..3", "3", "self_attention", "linear_qkv", "weight"]
        n = node.parent
        while n is not None:
            n.expand()
            n = n.parent
        await pilot.pause(0.1)
        tree.move_cursor(node)
        table = screen.query_one("#pieces")
        await wait_for(pilot, lambda: table.row_count == 2)
        assert "decoder.layers.3.self_attention.linear_qkv.weight" in str(table.border_title)
        form = await open_form(pilot, app, tmp_path / "out")
        form.query_one("#hf-config").value = str(megatron_root / "llama" / "reference")
        run = await run_to_end(pilot, app)
        assert "verified" in str(run.query_one("#result").render())
    assert_bit_equal(load(tmp_path / "out"), load(megatron_root / "llama" / "reference"))


@pytest.mark.asyncio
async def test_inspector_shows_the_architecture_check_in_the_background(fixtures_root):
    app = make_app(str(fixtures_root / "w3-buffers"))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_inspector(pilot, app)
        await wait_for(pilot, lambda: screen.verdict is not None, tries=1200)
        summary = " ".join(str(screen.query_one("#summary").render()).split())
        assert "check does not match Qwen2ForCausalLM: 27/27 tensors match; 3 extra " \
               "(model.loss_scale, model.no_elements, model.step_count)" in summary
    app = make_app(str(fixtures_root / "w2-dcp"))  # no config: skipped, and why
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_inspector(pilot, app)
        await wait_for(pilot, lambda: screen.verdict is not None, tries=1200)
        assert "skipped: no config.json" in str(screen.query_one("#summary").render())


@pytest.mark.asyncio
async def test_form_offers_no_strict_for_weights_that_do_not_match_the_model(fixtures_root,
                                                                            tmp_path):
    """w3-buffers holds three buffers Qwen2 does not define: the merge is refused, in the
    form's words, and ticking the form's not-strict box writes it (as --no-strict)."""
    src = fixtures_root / "w3-buffers"
    app = make_app(str(src))
    async with app.run_test(size=(120, 40)) as pilot:
        await open_inspector(pilot, app)
        await open_form(pilot, app, tmp_path / "refused")
        run = await run_to_end(pilot, app, tries=1200)
        result = str(run.query_one("#result").render())
        assert "do not match the model" in result and "--no-strict" not in result
        assert "not strict" in result
        await pilot.press("escape")
        await inspector_ready(pilot, app)
        form = await open_form(pilot, app, tmp_path / "written")
        form.query_one("#no-strict").value = True
        run = await run_to_end(pilot, app, tries=1200)
        assert "the merge failed" not in str(run.query_one("#status").render())
    assert (tmp_path / "written" / "model.safetensors").is_file()
    assert not (tmp_path / "refused").exists()
    card = (tmp_path / "written" / "README.md").read_text()
    assert "Written with --no-strict" in card
