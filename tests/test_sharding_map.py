"""The sharding map (issue 16): real FSDP2, HSDP, DCP, Megatron and DeepSpeed layouts drawn as
blocks by rank and mesh coordinate, in the app (`v`) and in `inspect --map`."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from conftest import copy_checkpoint, inspector_ready, wait_for
from shardscope.core import detect
from shardscope.tui.sharding_map import ShardingMap

from test_deepspeed import ds_root  # noqa: F401  (the real ZeRO checkpoints' fixture)


def draw(layout, name, width=48, height=9) -> list[str]:
    console = Console(width=width, color_system=None, record=True)
    with console.capture() as cap:
        console.print(ShardingMap(layout.tensors[name], layout, height=height))
    return cap.get().splitlines()


def test_fsdp2_row_shards_drawn_top_to_bottom(fixtures_root):
    layout = detect(str(fixtures_root / "w3-llama-f32"))
    t = layout.tensors["model.layers.0.self_attn.q_proj.weight"]
    blocks = ShardingMap(t, layout).blocks()
    # one block per stored piece, and together they tile the tensor exactly
    assert len(blocks) == len(t.pieces) == 3
    assert sum((k[1] - k[0]) * (k[3] - k[2]) for k in blocks) == math.prod(t.shape)
    lines = draw(layout, t.name)
    grid = lines[1:10]
    rows = [next(i for i, line in enumerate(grid) if f"r{r} ({r})" in line) for r in range(3)]
    assert rows == sorted(rows) and len(set(rows)) == 3  # rank 0 on top, rank 2 at the bottom
    for p in t.pieces:
        o = p.global_offsets[0]
        assert f"r{p.rank} (fsdp={p.coord[0]}): rows {o}:{o + p.shape[0]}, cols 0:{t.shape[1]}" \
            in "\n".join(lines)


def test_hsdp_names_mesh_coordinates_and_replication(fixtures_root):
    layout = detect(str(fixtures_root / "w4-hsdp"))
    text = "\n".join(draw(layout, "model.embed_tokens.weight", width=120))
    assert "r1 (ddp=0, fsdp=1)" in text
    assert "replicated over ddp (2): each block is also held by the 1 other ddp rank(s)" in text


def test_dcp_chunks(fixtures_root):
    layout = detect(str(fixtures_root / "w2-dcp"))
    name = next(n for n, t in layout.tensors.items() if len(t.shape) == 2)
    text = "\n".join(draw(layout, name))
    assert "r0" in text and "r1" in text and "·" not in text


def test_missing_rank_shows_as_a_gap(fixtures_root, tmp_path):
    src = copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    next(src.glob("*rank_2*")).unlink()
    layout = detect(str(src))
    lines = draw(layout, "model.layers.0.self_attn.q_proj.weight")
    assert any(set(line) == {"·"} for line in lines[1:10])  # the rows rank 2 held
    assert "r2" not in "\n".join(lines)


def test_megatron_tp_cut_of_q(megatron_root):
    pytest.importorskip("megatron.core")
    layout = detect(str(megatron_root / "llama" / "tp2_pp2" / "legacy"))
    t = layout.tensors["model.layers.3.self_attn.q_proj.weight"]
    text = "\n".join(draw(layout, t.name))
    assert len(t.pieces) == 2
    for p in t.pieces:
        coord = ", ".join(f"{n}={c}" for n, c in zip(layout.mesh_dim_names, p.coord))
        assert f"r{p.rank} ({coord}): rows {p.global_offsets[0]}:" in text


def test_deepspeed_flat_partitions(ds_root):
    """ZeRO-3 keeps each parameter as ranges of its flattened elements: drawn row-major, with
    the element ranges in the legend, together the whole tensor."""
    layout = detect(str(ds_root / "ds-z3-w3-tied"))
    t = layout.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert ShardingMap(t, layout).flat()
    text = "\n".join(draw(layout, t.name))
    assert "flat partitions" in text
    ends = []
    for p in sorted(t.pieces, key=lambda p: p.global_offsets):
        a = p.global_offsets[0]
        assert f"r{p.rank}: elements {a}:{a + p.shape[0]}" in text
        ends.append((a, a + p.shape[0]))
    assert ends[0][0] == 0 and ends[-1][1] == math.prod(t.shape)
    assert all(b == c for (_, b), (c, _) in zip(ends, ends[1:]))
    assert "·" not in text


def test_inspect_map_cli(fixtures_root, capsys):
    from shardscope.tui.cli import main

    assert main(["inspect", str(fixtures_root / "w4-hsdp"), "--map",
                 "model.norm.weight"]) == 0
    out = capsys.readouterr().out
    assert "model.norm.weight [64] F32" in out and "elements 0:32" in out
    assert main(["inspect", str(fixtures_root / "w4-hsdp"), "--map", "nope"]) == 2
    assert "no tensor named 'nope'" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_map_tab_follows_the_selection(fixtures_root):
    from test_app_usability import select
    from shardscope.tui.app import make_app
    from shardscope.tui.screens.inspector import InspectorScreen

    app = make_app(str(fixtures_root / "w3-llama-f32"))
    async with app.run_test(size=(80, 24)) as pilot:
        await inspector_ready(pilot, app)
        screen = app.screen
        await select(pilot, screen.query_one("#params"), "model.layers.1.mlp.up_proj.weight")
        await pilot.press("v")
        await pilot.pause(0.2)
        assert screen.query_one("#detail").active == "tab-map"
        view = screen.query_one("#map")
        assert view.tensor.name == "model.layers.1.mlp.up_proj.weight"
        assert view.region.height > 0


def test_tensor_without_pieces_says_so(fixtures_root):
    """A tensor none of whose pieces could be read (e.g. every file of it unreadable) is named
    as such, not drawn as a grid of gaps."""
    import dataclasses

    layout = detect(str(fixtures_root / "w2-qwen2-f32"))
    name = "model.embed_tokens.weight"
    layout.tensors[name] = dataclasses.replace(layout.tensors[name], pieces=[])
    text = "\n".join(draw(layout, name))
    assert "no stored piece of this tensor was found" in text and "·" not in text


def test_fsdp2_tp_strided_shard_and_row_parallel_blocks():
    """FSDP2 + TP written by torch 2.13 (a golden file, 61 rows: uneven): ``_StridedShard`` on
    the DP dim is drawn as torch defines it (the rows cut into TP chunks, each chunk into DP
    pieces; coordinate (dp i, tp j) holds piece i of chunk j, so rank (dp 1, tp 0) sits above
    rank (dp 0, tp 1)); a ``Shard(1)`` row-parallel weight is cut across; a replicated norm
    says so."""
    import torch

    from conftest import ROOT

    layout = detect(str(ROOT / "tests" / "data" / "torch_releases" / "2.13.0" / "fsdp2_tp_2x2"
                        / "checkpoint"))
    emb = layout.tensors["model.embed_tokens.weight"]
    lines = draw(layout, emb.name, width=60, height=12)
    text = "\n".join(lines)
    assert "StridedShard(0, 2)" in lines[0]
    rows = torch.arange(emb.shape[0])
    want = {}  # rank -> (first row, end row), by torch's definition of _StridedShard
    for j, chunk in enumerate(rows.chunk(2)):       # TP chunks
        for i, piece in enumerate(chunk.chunk(2)):  # DP pieces of each chunk
            want[2 * i + j] = (int(piece[0]), int(piece[-1]) + 1)
    for r, (a, b) in want.items():
        assert f"r{r} (dp={r // 2}, tp={r % 2}): rows {a}:{b}, cols 0:{emb.shape[1]}" in text
    grid = lines[1:13]
    order = [next(i for i, line in enumerate(grid) if f"r{r} (" in line) for r in (0, 2, 1, 3)]
    assert order == sorted(order) and len(set(order)) == 4  # top to bottom by first row
    assert "·" not in text

    o = layout.tensors["model.layers.0.self_attn.o_proj.weight"]  # (Shard(0), Shard(1))
    text = "\n".join(draw(layout, o.name, width=60, height=12))
    h, w = o.shape[0] // 2, o.shape[1] // 2
    assert f"r1 (dp=0, tp=1): rows 0:{h}, cols {w}:{o.shape[1]}" in text
    assert f"r2 (dp=1, tp=0): rows {h}:{o.shape[0]}, cols 0:{w}" in text

    text = "\n".join(draw(layout, "model.norm.weight", width=60))
    assert "replicated over tp (2)" in text
