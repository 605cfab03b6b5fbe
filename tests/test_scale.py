"""Many rank files: the fast zip directory parser (core/formats/torchsave.py) agrees with
zipfile, and damaged rank files (another rank's coordinate, a flipped pickle byte, a broken
storage header, a short storage) are still caught. (The per-run rank-file templates of the
scale branch were not merged: they predate the torch-release mesh records.)"""

from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path

import pytest

from conftest import copy_checkpoint
from core import detect

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


def _codes(layout, name):
    return {p.code for p in layout.problems if p.path and Path(p.path).name == name}


def test_a_rank_file_with_another_ranks_coordinate_is_caught(w3):
    """Rank 2's file says it holds rank 1's shard: its pickle matches rank 0's but for the
    coordinate, so it is recognised, and the placement arithmetic at that coordinate shows
    the clash (two ranks hold one box and rank 2's box is not covered)."""
    f = w3 / "model_world_size_3_rank_2.pt"
    _rewrite(f, edit_pickle=_coordinate_to(1))
    layout = detect(w3)
    assert layout.problems, "a rank file holding another rank's coordinate went unnoticed"
    assert any(p.code in ("shape-mismatch", "coverage-gap", "gap", "overlap") or
               "cover" in p.message or "gap" in p.message or "missing" in p.message
               for p in layout.problems), _problems(layout)


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


def test_a_damaged_storage_header_in_a_recognised_file_is_caught(w3):
    f = w3 / "model_world_size_3_rank_2.pt"
    with zipfile.ZipFile(f) as z:
        info = [i for i in z.infolist() if "/data/" in i.filename][5]
    _rewrite(f, edit_raw=lambda b: b.__setitem__(slice(info.header_offset,
                                                       info.header_offset + 4), b"XXXX") or b)
    layout = detect(w3)
    assert any("local header" in p.message for p in layout.problems
               if Path(p.path).name == f.name), _problems(layout)


def test_a_short_storage_in_a_recognised_file_is_caught(w3):
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


def test_fast_zip_directory_agrees_with_zipfile(fixtures_root):
    import mmap

    from core.formats.torchsave import _fast_directory

    for f in sorted((fixtures_root / "w4-hsdp").glob("*.pt")):
        with open(f, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            got = _fast_directory(mm, 0, len(mm))
            mm.close()
        with zipfile.ZipFile(f) as z:
            want = [(i.filename, i.compress_type, i.CRC, i.file_size, i.compress_size,
                     i.header_offset) for i in z.infolist()]
        assert got is not None and [tuple(e) for e in got] == want
        assert zlib.crc32(b"") == 0
