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
from .formats.torchsave import _fast_directory, _local_data_offset

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


def _records_of(path: str, bases: list[tuple[int, int]]) -> list[StorageRecord] | None:
    """Every data entry of the archives at ``bases`` ((start, length); ``length`` -1: to the
    end of the file) of ``path``; None when the file holds no zip archive (safetensors, a
    legacy pickle): nothing to check there."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError:
        return None  # the writer reports an unreadable file itself
    try:
        out = []
        for base, length in bases:
            length = size - base if length < 0 else length
            if bytes(mm[base:base + 4]) != b"PK\x03\x04":
                return None if base == 0 else out
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
                if "/data/" not in e.filename and not e.filename.startswith("data/"):
                    continue
                try:
                    at = _local_data_offset(mm, base, size, e, e.filename, path)
                except BadCheckpointError:
                    continue
                out.append(StorageRecord(path, e.filename, at, e.file_size, e.CRC))
        return out
    finally:
        mm.close()


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
    records: list[StorageRecord] = []
    unchecked: list[str] = []
    for path, uses in users.items():
        if not is_local(path):
            unchecked.append(path)
            continue
        recs = _records_of(path, sorted(set(bases.get(path, [(0, -1)]))))
        if recs is None:
            unchecked.append(path)
            continue
        recs.sort(key=lambda r: r.start)
        starts = [r.start for r in recs]
        used: dict[int, StorageRecord] = {}
        for off, name in uses:
            i = bisect.bisect_right(starts, off) - 1
            if i < 0 or off >= recs[i].start + max(recs[i].size, 1):
                continue  # not inside a record (cannot happen for a torch.save piece)
            r = used.setdefault(i, recs[i])
            if name not in r.tensors:
                r.tensors.append(name)
        records.extend(used[i] for i in sorted(used))
    return records, unchecked


def check_record(r: StorageRecord, cancel: threading.Event | None = None) -> bool:
    """True when the record's bytes match its CRC-32 (read in :data:`CHUNK` steps)."""
    crc, done = 0, 0
    fd = os.open(r.file, os.O_RDONLY)
    try:
        while done < r.size:
            if cancel is not None and cancel.is_set():
                return True
            block = os.pread(fd, min(CHUNK, r.size - done), r.start + done)
            if not block:
                return False
            crc = zlib.crc32(block, crc)
            done += len(block)
    finally:
        os.close(fd)
    return crc == r.crc


class CrcChecker(threading.Thread):
    """Checks ``records`` in the background, on ``threads`` threads (records are independent;
    zlib's ``crc32`` releases the GIL on large buffers); :meth:`result` joins it and raises
    :class:`BadCheckpointError` naming the file, the record and its tensors when one fails.
    A failure sets ``cancel``, which stops the writer."""

    def __init__(self, records: list[StorageRecord], cancel: threading.Event, threads: int = 1):
        super().__init__(name="shardscope-crc", daemon=True)
        self.records, self.cancel, self.threads = records, cancel, max(1, threads)
        self.failed: StorageRecord | None = None
        self.error: BaseException | None = None

    def _one(self, r: StorageRecord) -> None:
        if self.cancel.is_set():
            return
        try:
            ok = check_record(r, self.cancel)
        except OSError as e:
            self.error = BadCheckpointError(f"cannot read for the CRC-32 check: {e.strerror}",
                                            r.file)
            self.cancel.set()
            return
        if not ok and self.failed is None:
            self.failed = r
            self.cancel.set()  # stop the writer: its output is void

    def run(self):
        from concurrent.futures import ThreadPoolExecutor

        # largest first, so the threads finish together
        order = sorted(self.records, key=lambda r: -r.size)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="shardscope-crc") as pool:
            list(pool.map(self._one, order))

    def result(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error
        if self.failed is not None:
            raise crc_error(self.failed)


def crc_error(r: StorageRecord) -> BadCheckpointError:
    """The one-line refusal for a record whose CRC-32 fails."""
    names = r.tensors[:3] + ([f"... {len(r.tensors) - 3} more"] if len(r.tensors) > 3 else [])
    return BadCheckpointError(
        f"storage record {r.key.rsplit('/', 1)[-1]} (bytes {r.start}-{r.start + r.size}) fails "
        f"its CRC-32, the data of {', '.join(names)} is corrupt; nothing was written", r.file)
