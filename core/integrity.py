"""The CRC-32 check every merge makes of the storage records it reads.

Fact: ``torch.save`` writes a zip archive (miniz, ``torch/serialization.py``) whose every entry
carries a CRC-32 in its central directory; each storage is one entry ``<prefix>/data/<key>``,
stored uncompressed. DCP's ``FileSystemWriter`` (``torch/distributed/checkpoint/filesystem.py``
``_write_item``) embeds one such archive per tensor chunk in its ``.distcp`` files, so those are
covered too. safetensors files (Hugging Face, DCP's safetensors writer) and legacy non-zip
``torch.save`` files record no checksum: their bytes are not checked (``covered`` says so).

A merge copies tensor bytes with ``copy_file_range`` (the kernel, never through user space), so
the check reads each record again, whole, in its own thread while the writer works (zlib's
``crc32`` releases the GIL on large buffers; the second read comes from the page cache). A
record the merge uses only part of (a slice of a flat DeepSpeed partition, a Megatron vocab
padding cut) is still checked whole: the CRC covers the whole record, so the bytes not merged
are read too. Records no merged piece lies in (optimizer moments, other tensors) are not read.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import zlib
from dataclasses import dataclass, field

from .errors import BadCheckpointError
from .formats.torchsave import (DirectoryCache, _array_directory, _fast_directory,
                                _local_data_offset)

CHUNK = 16 * 1024 * 1024


@dataclass
class StorageRecord:
    """One storage entry of a ``torch.save`` archive: ``file``, ``key`` (entry name), absolute
    byte ``start`` of its data, ``size`` in bytes, the ``crc`` its zip directory records, and
    the output ``tensors`` whose pieces lie in it."""

    file: str
    key: str
    start: int
    size: int
    crc: int
    tensors: list[str] = field(default_factory=list)


def _records_of(path: str, bases: list[tuple[int, int]], directories=None
                ) -> list[tuple[int, int, int, str]] | None:
    """Every data entry of the archives at ``bases`` ((start, length); ``length`` -1: to the
    end of the file) of ``path``, as ``(data start, size, CRC-32, entry name)`` tuples (a
    :class:`StorageRecord` is made only for the records a merge uses); None when the file holds no zip archive (safetensors, a
    legacy pickle): nothing to check there. An entry whose local header is damaged is left
    out (the reader already refused such a file). ``directories``: a
    :class:`~.formats.torchsave.DirectoryCache` of the files listed before (rank files of
    one run share their directory's layout)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError:
        return None  # the writer reports an unreadable file itself
    try:
        out: list[tuple[int, int, int, str]] = []
        for base, length in bases:
            length = size - base if length < 0 else length
            if bytes(mm[base:base + 4]) != b"PK\x03\x04":
                return None if base == 0 else out
            # the numpy directory first: a rank file of a many-rank run holds ~1000 records,
            # and a Python step per record was most of a 256-rank merge's check
            table = _array_directory(mm, base, length, directories if base == 0 else None)
            if table is not None:
                out.extend(_array_records(mm, base, size, table, path))
                continue
            entries = _fast_directory(mm, base, length)
            if entries is None:
                import zipfile

                from .formats.torchsave import _Entry, _Window

                try:
                    with open(path, "rb") as f:
                        zf = zipfile.ZipFile(_Window(f, base, length))
                        entries = [_Entry((i.filename, i.compress_type, i.CRC, i.file_size,
                                           i.compress_size, i.header_offset))
                                   for i in zf.infolist()]
                except Exception:  # noqa: BLE001 - the reader already judged this archive
                    continue
            for e in entries:
                if not _is_data(e.filename):
                    continue
                try:
                    at = _local_data_offset(mm, base, size, e, e.filename, path)
                except BadCheckpointError:
                    continue
                out.append((at, e.file_size, e.CRC, e.filename))
        return out
    finally:
        mm.close()


def storage_crcs(path: str, directories=None) -> dict[int, tuple[int, int]]:
    """The storage records of the ``torch.save`` file ``path`` as recorded in its zip
    directory (no data read): byte where each record's data starts -> (size in bytes,
    CRC-32). Empty for a file that is not a zip archive or cannot be read. ``directories``:
    as for :func:`_records_of`."""
    return {start: (size, crc)
            for start, size, crc, _ in _records_of(path, [(0, -1)], directories) or ()}


def _is_data(name: str) -> bool:
    """A storage entry of a ``torch.save`` archive: ``<prefix>/data/<key>``."""
    return "/data/" in name or name.startswith("data/")


def _array_records(mm, base: int, size: int, table, path: str
                   ) -> list[tuple[int, int, int, str]]:
    """:func:`_records_of` for one archive whose directory is a
    :class:`~.formats.torchsave._ArrayDirectory`: every local header read at once with numpy
    (the same checks as :func:`_local_data_offset`: inside the file, its signature)."""
    import numpy as np

    idx = table.located.get("data")  # the same entries in every file of one layout
    if idx is None:
        idx = table.located["data"] = np.asarray(
            [i for i, n in enumerate(table.names) if _is_data(n)], dtype=np.int64)
    if not len(idx):
        return []
    at = table.hoff[idx] + base
    inside = at + 30 <= size
    idx, at = idx[inside], at[inside]
    raw = np.frombuffer(mm, dtype=np.uint8)
    heads = raw[at[:, None] + np.arange(30)]  # a copy: the mapping is free to close
    del raw
    good = (heads[:, :4] == np.frombuffer(b"PK\x03\x04", dtype=np.uint8)).all(axis=1)
    idx, at, heads = idx[good], at[good], heads[good]
    lens = heads[:, 26:30].astype(np.int64)
    data = at + 30 + lens[:, 0] + (lens[:, 1] << 8) + lens[:, 2] + (lens[:, 3] << 8)
    prefix, tails = table.prefix, table.tails
    return list(zip(data.tolist(), table.usize[idx].tolist(), table.crc[idx].tolist(),
                    [prefix + tails[i] for i in idx.tolist()]))


def plan_records(plan, is_local=lambda path: True) -> tuple[list[StorageRecord], list[str]]:
    """The storage records holding the bytes ``plan`` reads, each with the output tensors that
    use it, and the source files read without any check (no CRC recorded: safetensors, legacy
    ``torch.save``; or files on another node)."""
    bases: dict[str, list[tuple[int, int]]] = {}
    for t in plan.layout.tensors.values():
        for p in t.pieces:
            if p.archive is not None:
                bases.setdefault(p.file, []).append((p.archive[0], p.archive[1]))
    users: dict[str, list[tuple[int, str]]] = {}
    for of in plan.files:
        for t in of.tensors:
            pieces = list(t.pieces)
            if t.fold is not None:
                pieces += [*t.fold.a_pieces, *t.fold.b_pieces, *t.fold.m_pieces]
            for p in pieces:
                if p.numel:
                    users.setdefault(p.file, []).append((p.byte_offset, t.name))
    return _used_records(bases, users, is_local)


def layout_records(layout, names) -> tuple[list[StorageRecord], list[str]]:
    """:func:`plan_records` for the stored tensors ``names`` of ``layout`` read as they are
    (``verify --reference``: no plan), their pieces located as the reader does."""
    bases: dict[str, list[tuple[int, int]]] = {}
    users: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        for p in layout.tensors[name].pieces:
            if not p.numel:
                continue
            if p.archive is not None:
                bases.setdefault(p.file, []).append((p.archive[0], p.archive[1]))
                if layout.resolve_piece is not None:
                    p = layout.resolve_piece(p)
            users.setdefault(p.file, []).append((p.byte_offset, name))
    return _used_records(bases, users, lambda path: True)


def _used_records(bases, users, is_local) -> tuple[list[StorageRecord], list[str]]:
    """The records of ``users`` (file -> (byte offset, tensor name) of each piece read), the
    archives of a file at ``bases`` (file -> (start, length); else one at byte 0)."""
    records: list[StorageRecord] = []
    unchecked: list[str] = []
    directories = DirectoryCache()
    for path, uses in users.items():
        if not is_local(path):
            unchecked.append(path)
            continue
        recs = _records_of(path, sorted(set(bases.get(path, [(0, -1)]))), directories)
        if recs is None:
            unchecked.append(path)
            continue
        recs.sort()
        starts = [r[0] for r in recs]
        used: dict[int, StorageRecord] = {}
        for off, name in uses:
            i = bisect.bisect_right(starts, off) - 1
            if i < 0 or off >= recs[i][0] + max(recs[i][1], 1):
                continue  # not inside a record (cannot happen for a torch.save piece)
            r = used.get(i)
            if r is None:
                start, nbytes, crc, key = recs[i]
                r = used[i] = StorageRecord(path, key, start, nbytes, crc)
            if name not in r.tensors:
                r.tensors.append(name)
        records.extend(used[i] for i in sorted(used))
    return records, unchecked


def check_record(r: StorageRecord, cancel: threading.Event | None = None) -> bool:
    """True when the record's bytes match its CRC-32 (read in :data:`CHUNK` steps)."""
    fd = os.open(r.file, os.O_RDONLY)
    try:
        return _check_open(fd, r, cancel)
    finally:
        os.close(fd)


def check_file(records: list[StorageRecord], cancel: threading.Event | None = None
               ) -> StorageRecord | None:
    """Check ``records`` (all of one file) against their CRC-32s, the first failing record
    returned (None: all good, or cancelled). The file is opened once and records smaller
    than :data:`CHUNK` are read together, a span of up to :data:`CHUNK` bytes per read: a
    rank file of a many-rank run holds ~1000 records of a few KiB, and an open and a read per
    record cost more than their CRC. Raises ``OSError`` when the file cannot be read."""
    recs = sorted(records, key=lambda r: r.start)
    fd = os.open(recs[0].file, os.O_RDONLY)
    try:
        i = 0
        while i < len(recs):
            if cancel is not None and cancel.is_set():
                return None
            r = recs[i]
            if r.size >= CHUNK:
                if not _check_open(fd, r, cancel):
                    return r
                i += 1
                continue
            j, end = i, r.start + r.size
            while (j + 1 < len(recs) and recs[j + 1].size < CHUNK
                   and recs[j + 1].start + recs[j + 1].size - r.start <= CHUNK):
                j += 1
                end = max(end, recs[j].start + recs[j].size)
            span = memoryview(os.pread(fd, end - r.start, r.start))
            for q in recs[i:j + 1]:
                at = q.start - r.start
                if len(span) < at + q.size or zlib.crc32(span[at:at + q.size]) != q.crc:
                    return q
            i = j + 1
    finally:
        os.close(fd)
    return None


def _check_open(fd: int, r: StorageRecord, cancel: threading.Event | None) -> bool:
    """One record of the open file ``fd`` read in :data:`CHUNK` steps (cancel honoured
    between steps: True then)."""
    crc, done = 0, 0
    while done < r.size:
        if cancel is not None and cancel.is_set():
            return True
        block = os.pread(fd, min(CHUNK, r.size - done), r.start + done)
        if not block:
            return False
        crc = zlib.crc32(block, crc)
        done += len(block)
    return crc == r.crc


class CrcChecker(threading.Thread):
    """Checks ``records`` in the background, on ``threads`` threads, a file at a time
    (:func:`check_file`; files are independent, and zlib's ``crc32`` releases the GIL on
    large buffers); :meth:`result` joins it and raises :class:`BadCheckpointError` naming the
    file, the record and its tensors when one fails. A failure sets ``cancel``, which stops
    the writer."""

    def __init__(self, records: list[StorageRecord], cancel: threading.Event, threads: int = 1,
                 consequence: str = "nothing was written"):
        super().__init__(name="shardscope-crc", daemon=True)
        self.records, self.cancel, self.threads = records, cancel, max(1, threads)
        #: the end of the refusal (what the failure means for the command)
        self.consequence = consequence
        self.failed: StorageRecord | None = None
        self.error: BaseException | None = None

    def _one(self, records: list[StorageRecord]) -> None:
        if self.cancel.is_set():
            return
        try:
            bad = check_file(records, self.cancel)
        except OSError as e:
            self.error = BadCheckpointError(f"cannot read for the CRC-32 check: {e.strerror}",
                                            records[0].file)
            self.cancel.set()
            return
        if bad is not None and self.failed is None:
            self.failed = bad
            self.cancel.set()  # stop the writer: its output is void

    def run(self):
        from concurrent.futures import ThreadPoolExecutor

        by_file: dict[str, list[StorageRecord]] = {}
        for r in self.records:
            by_file.setdefault(r.file, []).append(r)
        # largest files first, so the threads finish together
        order = sorted(by_file.values(), key=lambda rs: -sum(r.size for r in rs))
        with ThreadPoolExecutor(self.threads, thread_name_prefix="shardscope-crc") as pool:
            list(pool.map(self._one, order))

    def result(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error
        if self.failed is not None:
            raise crc_error(self.failed, self.consequence)


def crc_error(r: StorageRecord, consequence: str = "nothing was written"
              ) -> BadCheckpointError:
    """The one-line refusal for a record whose CRC-32 fails."""
    names = r.tensors[:3] + ([f"... {len(r.tensors) - 3} more"] if len(r.tensors) > 3 else [])
    return BadCheckpointError(
        f"storage record {r.key.rsplit('/', 1)[-1]} (bytes {r.start}-{r.start + r.size}) fails "
        f"its CRC-32, the data of {', '.join(names)} is corrupt; {consequence}", r.file,
        code="checksum-mismatch")


def start_check(records: list[StorageRecord], consequence: str, threads: int = 2
                ) -> CrcChecker | None:
    """A :class:`CrcChecker` of ``records`` started on its own cancel event (``diff``,
    ``verify --reference``: overlapping the comparison, which polls ``checker.failed``), or
    None when there is nothing to check."""
    if not records:
        return None
    checker = CrcChecker(records, threading.Event(), threads, consequence)
    checker.start()
    return checker
