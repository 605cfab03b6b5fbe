"""``inspect --deep``: read every byte once — check the CRC-32 that ``torch.save`` archives
record for each storage (a flipped byte in tensor data shows here), and count NaN/Inf per
tensor. Streaming: one storage chunk or one tensor in memory at a time.

Fact: ``torch.save`` writes its zip with CRC-32 for every entry (miniz, torch/serialization.py);
DCP embeds one such archive per chunk in its ``.distcp`` files. safetensors has no checksum.
"""

from __future__ import annotations

import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Callable

from .errors import BadCheckpointError, MergeCancelled
from .formats.torchsave import _Window
from .layout import CheckpointLayout, Problem

CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class DeepProgress:
    """``done``/``total``: steps (archives checked, then tensors scanned); ``what``: the
    file or tensor just finished."""

    done: int
    total: int
    what: str


def _archives(layout: CheckpointLayout) -> list[tuple[str, int, int]]:
    """(file, byte offset, length) of every torch.save archive holding the layout's data."""
    seen: dict[tuple[str, int, int], None] = {}
    for t in layout.tensors.values():
        for p in t.pieces:
            if p.archive is not None:
                seen[(p.file, p.archive[0], p.archive[1])] = None
            elif layout.format in ("fsdp", "megatron-legacy", "hf-bin"):
                seen[(p.file, 0, -1)] = None
    return list(seen)


def _owners(layout: CheckpointLayout):
    """A function (file, archive byte, storage data byte, storage bytes) -> the tensors whose
    pieces that storage holds, as text (``q_proj.weight [0:32]``-like: names with the
    slice's global offsets when the tensor is cut), for messages that name what is corrupt."""
    by_file: dict[str, list] = {}
    for name, t in layout.tensors.items():
        for p in t.pieces:
            by_file.setdefault(p.file, []).append((name, p))

    def owners(path: str, base: int, data: int, size: int) -> str:
        hit = []
        for name, p in by_file.get(path, ()):
            inside = (p.archive[0] == base if p.archive is not None
                      else data <= p.byte_offset < data + max(size, 1))
            if inside:
                cut = any(p.global_offsets) or len(layout.tensors[name].pieces) > 1
                hit.append(f"{name} (the piece at {list(p.global_offsets)})" if cut else name)
        hit = list(dict.fromkeys(hit))
        if not hit:
            return ""
        return ", ".join(hit[:3]) + (f" and {len(hit) - 3} more" if len(hit) > 3 else "")

    return owners


def _check_crc(path: str, base: int, length: int, owners=None) -> list[Problem]:
    """CRC-32 of every storage of the torch.save archive at byte ``base`` of ``path``
    (``length`` bytes, -1: to the end); ``owners`` (:func:`_owners`) names the tensors of a
    failing storage."""
    import struct

    out = []
    with open(path, "rb") as f:
        if length < 0:
            f.seek(0, 2)
            length = f.tell()
        try:
            zf = zipfile.ZipFile(_Window(f, base, length))
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            f.seek(base)
            if base == 0 and f.read(1) == b"\x80":  # legacy (non-zip) torch.save: no CRC
                return [Problem("no-checksum", "legacy (non-zip) torch.save file: it records "
                                "no CRC-32, flipped bytes cannot be found", path, "warning")]
            return [Problem("unreadable-file", f"not a zip archive at byte {base} ({e})", path)]
        for info in zf.infolist():
            if "/data/" not in info.filename and not info.filename.startswith("data/"):
                continue
            crc = 0
            try:
                with zf.open(info) as fh:
                    # zipfile checks the CRC itself at the end of the entry and raises
                    while block := fh.read(CHUNK):
                        crc = zlib.crc32(block, crc)
            except zipfile.BadZipFile:
                f.seek(base + info.header_offset)  # the local header: where the data starts
                n, m = struct.unpack("<HH", f.read(30)[26:30])
                data = base + info.header_offset + 30 + n + m
                who = owners(path, base, data, info.file_size) if owners else ""
                where = (f"archive at byte {base}, " if base else "") + \
                    f"data at bytes {data}-{data + info.file_size}"
                out.append(Problem("checksum-mismatch", (f"{who}: " if who else "")
                                   + f"storage {info.filename.rsplit('/', 1)[-1]} ({where}) "
                                   "fails its CRC-32: the data is corrupt", path))
            except (OSError, EOFError) as e:
                out.append(Problem("truncated-file", f"storage {info.filename}: {e}", path))
    return out


def _replica_problems(layout: CheckpointLayout, bad_files: set) -> list[Problem]:
    """``replica-mismatch`` for copies of one place that differ in their bytes (HSDP replicas,
    replicated buffers: the merge takes the first copy, so a replica rank file of another run
    or a damaged one would otherwise go unseen while every rank file is present). One problem
    per file holding differing copies, naming the tensors."""
    from pathlib import Path

    copies = [c for c in getattr(layout, "replica_copies", None) or ()
              if c[1].file not in bad_files and c[2].file not in bad_files]
    if not copies:
        return []
    from .formats.fsdp import _disagreeing_copies

    bad = set(_disagreeing_copies(copies))
    by_file: dict[tuple[str, str], list[str]] = {}
    for name, kept, other in copies:
        if name in bad and name not in by_file.get((kept.file, other.file), []):
            by_file.setdefault((kept.file, other.file), []).append(name)
    return [Problem("replica-mismatch", f"{len(names)} tensor(s) differ between this file "
                    f"and {Path(kept).name}, replicas that should hold the same bytes (one of "
                    f"the two is damaged or from another run): {', '.join(names[:3])}"
                    f"{', ...' if len(names) > 3 else ''}", other)
            for (kept, other), names in by_file.items()]


def deep_check(layout: CheckpointLayout,
               on_progress: Callable[[DeepProgress], None] | None = None,
               cancel: threading.Event | None = None) -> list[Problem]:
    """Read every tensor byte of ``layout``: ``checksum-mismatch`` problems for storages whose
    CRC-32 fails, ``nan-inf`` warnings naming each tensor with NaN or Inf values (and their
    counts). Raises :class:`MergeCancelled` when ``cancel`` is set."""
    import torch

    from .dtypes import FLOATING
    from .verify import read_tensor

    archives = _archives(layout)
    total = len(archives) + len(layout.tensors)
    done = 0
    problems: list[Problem] = []
    owners = _owners(layout)
    for path, base, length in archives:
        if cancel is not None and cancel.is_set():
            raise MergeCancelled("cancelled")
        problems.extend(_check_crc(path, base, length, owners))
        done += 1
        if on_progress:
            on_progress(DeepProgress(done, total, path))
    bad_files = {p.path for p in problems}
    problems.extend(_replica_problems(layout, bad_files))
    for name, t in layout.tensors.items():
        if cancel is not None and cancel.is_set():
            raise MergeCancelled("cancelled")
        done += 1
        if t.dtype in FLOATING and not any(p.file in bad_files for p in t.pieces):
            try:
                x = read_tensor(layout, name)
            except BadCheckpointError as e:
                problems.append(Problem("unreadable-file", e.message, e.path))
                continue
            if t.dtype.startswith("F8"):  # isinf has no float8 kernel; exact in float32
                x = x.to(torch.float32)
            nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            if nan or inf:
                problems.append(Problem("nan-inf", f"{name}: {nan} NaN and {inf} Inf of "
                                        f"{x.numel()} values", t.pieces[0].file if t.pieces
                                        else None, "warning"))
        if on_progress:
            on_progress(DeepProgress(done, total, name))
    return problems
