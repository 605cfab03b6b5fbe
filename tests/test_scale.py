"""Many rank files: a rank file whose pickle equals an earlier one's but for its mesh
coordinate is read from that file's template (core/formats/fsdp.py ``_Template``); the
layout is the full parse's, and damaged rank files (another rank's coordinate, a flipped
pickle byte, a broken storage header, a short storage, a file of another rank) are still
caught. The fast zip directory parser (core/formats/torchsave.py) agrees with zipfile.
Streamed casts (core/execute.py ``_cast_range``) give torch's ``.to()`` across steps."""

from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path

import pytest

from conftest import copy_checkpoint
from shardscope.core import detect

def _problems(layout):
    return sorted((p.code, p.message, p.path) for p in layout.problems)


def _rewrite(f: Path, edit_pickle=None, edit_raw=None) -> None:
    """Rewrite the zip of a torch.save file with its pickle edited (CRC-32 recomputed, as a
    writer that produced these bytes would have), or edit its raw bytes."""
    if edit_pickle is not None:
        with zipfile.ZipFile(f) as z:
            items = [(i, z.read(i)) for i in z.infolist()]
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            for info, data in items:
                z.writestr(info, edit_pickle(data) if info.filename.endswith("data.pkl")
                           else data)
    if edit_raw is not None:
        f.write_bytes(edit_raw(bytearray(f.read_bytes())))


def _coordinate_to(value: int):
    """Set the (1-D) mesh coordinate a pickled DeviceMesh records to ``value``."""
    def edit(data: bytes) -> bytes:
        import io
        import pickletools

        i = data.index(b"_coordinate_on_dim") + len(b"_coordinate_on_dim")
        for op, _, pos in pickletools.genops(io.BytesIO(data[i:i + 32])):
            if op.name == "BININT1":
                at = i + pos + 1
                return data[:at] + bytes([value]) + data[at + 1:]
        raise AssertionError(data[i:i + 32])
    return edit


@pytest.fixture
def w3(fixtures_root, tmp_path):
    return copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")


@pytest.fixture
def recognised(monkeypatch):
    """The rank files (in the order read) whose pickle a template recognised."""
    from shardscope.core.formats import fsdp

    seen: list[bool] = []
    reuse = fsdp._Templates.reuse

    def spy(self, data):
        got = reuse(self, data)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(fsdp._Templates, "reuse", spy)
    return seen


def _full_parse(monkeypatch):
    """Read every rank file in full (no template recognises a pickle, no directory cache
    recognises a zip directory)."""
    from shardscope.core.formats import fsdp, torchsave

    monkeypatch.setattr(fsdp._Templates, "reuse", lambda self, data: None)
    monkeypatch.setattr(torchsave.DirectoryCache, "match", lambda self, cd: None)


def _summary(layout):
    return ({n: (t.shape, t.dtype, t.placement, sorted(t.pieces, key=lambda p: (p.file, p.byte_offset)))
             for n, t in layout.tensors.items()},
            [(p.code, p.message, p.path, p.severity) for p in layout.problems],
            layout.mesh_shape, layout.mesh_dim_names, layout.parallel, layout.notes,
            [(f.path, f.status, f.rank) for f in layout.files])


@pytest.mark.parametrize("name", ["w3-llama-f32", "w4-fsdp2", "w4-hsdp", "w4-hsdp-other-names",
                                  "w3-unnamed-bf16-tied", "w2-accelerate-rank", "w3-buffers"])
def test_templates_give_the_full_parse_layout(fixtures_root, monkeypatch, recognised, name):
    """Rank files read from a template give the same tensors, pieces (file, byte offset,
    global offsets, coordinate), problems and mesh as reading every pickle in full."""
    fast = detect(fixtures_root / name)
    hits = list(recognised)
    _full_parse(monkeypatch)
    assert _summary(fast) == _summary(detect(fixtures_root / name))
    if name in ("w3-llama-f32", "w4-fsdp2", "w4-hsdp"):  # not vacuous: some were replayed
        assert any(hits), hits


def test_a_rank_file_of_another_rank_in_a_recognised_run_is_caught(fixtures_root, tmp_path,
                                                                   recognised):
    """Rank 1's file copied over rank 2's (same local shapes, so its pickle matches the
    template but for the coordinate): refused as a duplicate of rank 1's file."""
    ck = copy_checkpoint(fixtures_root / "w4-fsdp2", tmp_path / "ck")
    (ck / "model_world_size_4_rank_2.pt").write_bytes(
        (ck / "model_world_size_4_rank_1.pt").read_bytes())
    layout = detect(ck)
    assert recognised[2], recognised
    # one error naming both files (the reader's duplicate-rank), not a coverage gap per tensor
    dup = [p for p in layout.errors if p.code == "duplicate-rank"]
    assert len(dup) == 1 and "model_world_size_4_rank_1.pt" in dup[0].message, \
        _problems(layout)


def _codes(layout, name):
    return {p.code for p in layout.problems if p.path and Path(p.path).name == name}


def test_a_rank_file_with_another_ranks_coordinate_is_caught(w3, recognised):
    """Rank 1's file says it holds rank 0's shard: its pickle matches rank 0's but for the
    coordinate, so it is recognised, and the placement arithmetic at that coordinate shows
    the clash: a duplicate of rank 0's file (two files hold one box)."""
    f = w3 / "model_world_size_3_rank_1.pt"
    _rewrite(f, edit_pickle=_coordinate_to(0))
    layout = detect(w3)
    assert recognised == [False, True, False], recognised  # rank 2 holds fewer rows
    dup = [p for p in layout.errors if p.code == "duplicate-rank"]
    assert len(dup) == 1 and "model_world_size_3_rank_0.pt" in dup[0].message, \
        _problems(layout)


def test_a_flipped_byte_in_a_recognised_pickle_is_caught(w3):
    f = w3 / "model_world_size_3_rank_1.pt"
    data = f.read_bytes()
    with zipfile.ZipFile(f) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    n, m = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    at = info.header_offset + 30 + n + m + info.file_size // 2
    _rewrite(f, edit_raw=lambda b: b.__setitem__(at, b[at] ^ 0x10) or b)
    layout = detect(w3)
    assert _codes(layout, f.name), _problems(layout)
    assert [s.status for s in layout.files if s.rank == 1] == ["unreadable"]


def test_a_damaged_storage_header_in_a_recognised_file_is_caught(w3, recognised):
    f = w3 / "model_world_size_3_rank_1.pt"
    with zipfile.ZipFile(f) as z:
        info = [i for i in z.infolist() if "/data/" in i.filename][5]
    _rewrite(f, edit_raw=lambda b: b.__setitem__(slice(info.header_offset,
                                                       info.header_offset + 4), b"XXXX") or b)
    layout = detect(w3)
    assert any("local header" in p.message for p in layout.problems
               if Path(p.path).name == f.name), _problems(layout)
    assert recognised[1], recognised


def test_a_short_storage_in_a_recognised_file_is_caught(w3, recognised):
    """A file cut inside its last storage (its directory moved to fit) is refused: the
    storage holds fewer bytes than its tensor needs."""
    f = w3 / "model_world_size_3_rank_1.pt"
    with zipfile.ZipFile(f) as z:
        items = [(i, z.read(i)) for i in z.infolist()]
    big = max((x for x in items if "/data/" in x[0].filename), key=lambda x: len(x[1]))
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        for info, data in items:
            z.writestr(info, data[:len(data) // 2] if info is big[0] else data)
    layout = detect(w3)
    assert any("expected" in p.message for p in layout.problems
               if Path(p.path).name == f.name), _problems(layout)
    assert recognised[1], recognised


def test_fast_zip_directory_agrees_with_zipfile(fixtures_root):
    import mmap

    from shardscope.core.formats.torchsave import _array_directory, _fast_directory

    for f in sorted((fixtures_root / "w4-hsdp").glob("*.pt")):
        with open(f, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            got = _fast_directory(mm, 0, len(mm))
            mm.close()
        with zipfile.ZipFile(f) as z:
            want = [(i.filename, i.compress_type, i.CRC, i.file_size, i.compress_size,
                     i.header_offset) for i in z.infolist()]
        assert got is not None and [tuple(e) for e in got] == want
        with open(f, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            arrays = _array_directory(mm, 0, len(mm))
            mm.close()
        assert arrays is not None and [tuple(arrays.get(n)) for n in arrays] == want
        assert zlib.crc32(b"") == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_streamed_cast_is_torch_to_across_steps(fixtures_root, tmp_path, monkeypatch, dtype):
    """A --dtype merge cast in steps of 1000 elements (short last steps, boundaries inside
    every tensor) equals the reference's ``.to()`` bit for bit, and leaves torch's thread
    count as it was."""
    import torch
    from safetensors.torch import load_file

    import shardscope.core.execute
    from shardscope import core
    from shardscope.core import MergeOptions, plan_merge, run_merge

    monkeypatch.setattr(core.execute, "CAST_STEP", 1000)
    threads = torch.get_num_threads()
    out = tmp_path / "out"
    run_merge(plan_merge(detect(fixtures_root / "w3-llama-f32"),
                         MergeOptions(output=str(out), dtype=dtype, workers=2)))
    assert torch.get_num_threads() == threads
    want_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    ref = load_file(fixtures_root / "w3-llama-f32.reference" / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert set(got) == set(ref)
    assert any(v.numel() > 1000 for v in ref.values())
    for k, v in ref.items():
        assert got[k].dtype == want_dtype and torch.equal(got[k], v.to(want_dtype)), k


@pytest.fixture
def directory_hits(monkeypatch):
    """The rank files (names) whose zip directory the DirectoryCache recognised."""
    from shardscope.core.formats import torchsave

    hits: list[bool] = []
    match = torchsave.DirectoryCache.match

    def spy(self, cd):
        got = match(self, cd)
        hits.append(got)
        return got

    monkeypatch.setattr(torchsave.DirectoryCache, "match", spy)
    return hits


def test_directories_of_rank_files_with_longer_names_are_recognised(
        many16_root, monkeypatch, directory_hits):
    """Twelve real rank files: ranks 10 and 11 are saved under a longer archive folder than
    ranks 0-9, and the last ranks hold fewer rows (other storage sizes). The directories
    recognised from another file's give the layout of parsing each in full, and the folder,
    CRC-32 values and local header offsets are each file's own."""
    ck = many16_root / "w16-fsdp2"
    fast = detect(ck)
    got = [d for d in directory_hits if d is not None]
    assert any(d.prefix == "model_world_size_16_rank_11/" for d in got), \
        [d.prefix for d in got]
    _full_parse(monkeypatch)
    full = detect(ck)
    assert _summary(fast) == _summary(full)
    assert not fast.problems, _problems(fast)
    for d in got:  # each recognised directory against zipfile's reading of its file
        f = ck / (d.prefix.rstrip("/") + ".pt")
        with zipfile.ZipFile(f) as z:
            want = [(i.filename, i.compress_type, i.CRC, i.file_size, i.compress_size,
                     i.header_offset) for i in z.infolist()]
        assert [tuple(d.get(n)) for n in d] == want


@pytest.mark.parametrize("damage", ["entry-size", "entry-name", "local-header"])
def test_a_damaged_directory_of_a_recognised_layout_is_caught(many16_root, tmp_path,
                                                              monkeypatch, damage):
    """A rank file whose directory differs from the recognised layout's in a field that
    matters (an entry's size, an entry's name) or whose local header is broken gives the
    problems of parsing it in full, naming that file."""
    ck = copy_checkpoint(many16_root / "w16-fsdp2", tmp_path / "ck")
    f = ck / "model_world_size_16_rank_10.pt"
    with zipfile.ZipFile(f) as z:
        info = [i for i in z.infolist() if "/data/" in i.filename][3]
    data = bytearray(f.read_bytes())
    name = info.filename.encode()
    # the central directory entry of ``info``: its name follows its 46 fixed bytes
    at = data.rindex(name) - 46
    assert data[at:at + 4] == b"PK\x01\x02"
    if damage == "entry-size":
        size = struct.unpack_from("<I", data, at + 24)[0]
        struct.pack_into("<I", data, at + 24, size - 4)
        struct.pack_into("<I", data, at + 20, size - 4)
    elif damage == "entry-name":
        data[at + 46 + len(name) - 1] ^= 0x01  # "data/3" -> "data/2": a name twice
    else:
        data[info.header_offset:info.header_offset + 4] = b"XXXX"
    f.write_bytes(bytes(data))
    fast = detect(ck)
    _full_parse(monkeypatch)
    full = detect(ck)
    assert _problems(fast) == _problems(full)
    assert any(Path(p.path).name == f.name for p in fast.problems), _problems(fast)


def test_a_recognised_rank_file_whose_coordinate_gives_other_shapes_is_caught(
        many16_root, tmp_path, monkeypatch, recognised):
    """Rank 3's file claiming the coordinate of rank 15 (which holds fewer embedding rows:
    500 is not a multiple of 16) is recognised by its pickle, and gives the problems of
    parsing every file in full: its local shapes are not what its placement gives there."""
    ck = copy_checkpoint(many16_root / "w16-fsdp2", tmp_path / "ck")
    f = ck / "model_world_size_16_rank_3.pt"
    _rewrite(f, edit_pickle=_coordinate_to(15))
    fast = detect(ck)
    assert recognised[3], recognised
    _full_parse(monkeypatch)
    full = detect(ck)
    assert _problems(fast) == _problems(full)
    assert any(p.code == "shape-mismatch" and Path(p.path).name == f.name
               for p in fast.problems), _problems(fast)


def test_crc_records_of_recognised_directories_are_each_files_own(many16_root, directory_hits):
    """The storage records the merge's CRC-32 check lists (core/integrity.py) from zip
    directories recognised from another rank file's are the records of the file itself."""
    from shardscope.core.formats.torchsave import DirectoryCache
    from shardscope.core.integrity import _records_of

    cache = DirectoryCache()
    files = sorted((many16_root / "w16-fsdp2").glob("*.pt"))
    for f in files:
        with zipfile.ZipFile(f) as z:
            crcs = {i.filename: (i.CRC, i.file_size) for i in z.infolist()}
        got = _records_of(str(f), [(0, -1)], cache)
        assert got == _records_of(str(f), [(0, -1)])
        assert {name: (crc, size) for _, size, crc, name in got} == \
            {n: v for n, v in crcs.items() if "/data/" in n}
    assert sum(d is not None for d in directory_hits) >= len(files) - 4, directory_hits
