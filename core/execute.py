"""Execute a :class:`MergePlan`: move the bytes into safetensors files, streaming.

This module is the product, so it is our own code rather than ``safetensors.torch.save_file``
(which needs every tensor of a file in memory at once): the header of each output file is
computed from the plan, then every tensor is written at its known offset with ``os.pwrite``
or, when its pieces are stored rows of the output in the same dtype, copied by the kernel with
``os.copy_file_range`` (no pass through user space). Memory is bounded by the tensors in
flight (at most ``workers`` of them), never the model. Knows bytes, nothing about formats.

Output is written to a hidden temporary folder beside the target and renamed into place only
when complete; cancel (a ``threading.Event``), an error or Ctrl-C removes it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from .dtypes import ITEMSIZE
from .errors import BadCheckpointError, MergeCancelled, OutputWriteError, UsageError
from .layout import Piece
from .plan import MergePlan, OutputTensor, check_output

TMP_MARK = ".shardscope-tmp-"
COPY_CHUNK = 64 * 1024 * 1024  # bytes per pread/pwrite or copy_file_range call


@dataclass(frozen=True)
class MergeProgress:
    """A progress report, passed to ``on_progress`` from worker threads.

    ``bytes_written``/``bytes_total``: output tensor bytes so far / in all. ``source``: the
    source file just read from, with ``source_read``/``source_total`` bytes of it.
    ``tensor``: the tensor just finished (or ``""``), ``output_file``: the file it went to.
    """

    bytes_written: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    source: str = ""
    source_read: int = 0
    source_total: int = 0
    tensor: str = ""
    output_file: str = ""


@dataclass
class MergeResult:
    """What a finished merge wrote: output folder, (file name, bytes) pairs, tensor bytes,
    wall time in seconds, and warnings."""

    output: str
    files: list[tuple[str, int]]
    tensor_bytes: int
    seconds: float
    tensors: int
    warnings: list[str] = field(default_factory=list)
    #: storage records whose CRC-32 was checked, and source files read without a check (no
    #: CRC recorded: safetensors, legacy torch.save; or on another node)
    crc_records: int = 0
    crc_unchecked: list[str] = field(default_factory=list)


def temp_dir_for(out: Path) -> Path:
    return out.parent / f".{out.name}{TMP_MARK}{os.getpid()}"


def stale_temp_dirs(out: Path) -> list[Path]:
    """Temporary folders beside ``out`` left by merges whose process is gone (killed)."""
    return left_by_dead_merges(out, "")


def left_by_dead_merges(out: Path, tag: str) -> list[Path]:
    """The folders ``.OUT<TMP_MARK><tag><PID>`` beside ``out`` whose process ``PID`` is gone
    (``tag`` "": a merge's temporary folder; "old-": an output an ``--overwrite`` merge set
    aside, core/plan.py ``recover_set_aside``), in name order."""
    found = []
    if not out.parent.is_dir():
        return found
    prefix = f".{out.name}{TMP_MARK}{tag}"
    for p in sorted(out.parent.iterdir()):
        if p.name.startswith(prefix):
            try:
                pid = int(p.name[len(prefix):])
            except ValueError:
                continue
            if pid != os.getpid() and not _alive(pid):
                found.append(p)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def safetensors_header(tensors: list[OutputTensor]) -> bytes:
    """The header of a safetensors file holding ``tensors`` in order: 8-byte length, JSON
    (with ``__metadata__: {"format": "pt"}`` as transformers writes it), padded with spaces to
    a multiple of 8 bytes so the data is aligned."""
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class _Sources:
    """Open source files, shared by the worker threads (positional reads only)."""

    def __init__(self):
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self.lock:
            fd = self.fds.get(path)
            if fd is None:
                try:
                    fd = self.fds[path] = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise BadCheckpointError(f"cannot open: {e.strerror}", path) from None
            return fd

    def read(self, path: str, n: int, offset: int):
        """``n`` bytes of ``path`` from byte ``offset`` (a buffer; core/distributed.py
        overrides it to fetch the bytes of files held by another node)."""
        return _pread_exact(self.fd(path), n, offset, path)

    def local(self, path: str) -> bool:
        """True when ``path`` is a file on this machine (one the kernel may copy from)."""
        return True

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _pread_exact(fd: int, n: int, offset: int, path: str, buf=None) -> bytearray:
    buf = bytearray(n) if buf is None else buf
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = os.preadv(fd, [view[got:got + COPY_CHUNK]], offset + got)
        except OSError as e:  # EIO from a bad disk: the checkpoint's file, named
            raise BadCheckpointError(f"cannot read at byte {offset + got}: {e.strerror}",
                                     path) from None
        if k <= 0:
            raise BadCheckpointError(f"short read at byte {offset + got}: the file changed or is "
                                     "truncated", path)
        got += k
    return buf


#: elements a streamed cast reads, converts and writes at a time (4 MiB of F32): buffers reused
#: across steps and pieces (:func:`_cast_buffers`) cost no page faults, and memory stays
#: bounded whatever the tensor's size
CAST_STEP = 1 << 20


def _torch():
    """``torch``, imported with Python's cyclic garbage collector paused while it loads: the
    import makes tens of thousands of objects, so it triggers full collections that walk every
    object the process holds (the layout and the plan too); in a merge process that had planned
    the 4 GB checkpoint the import took 2.2-2.4 CPU s paused, 3.1-3.5 s collecting (loaded VM).
    The collector is restored as it was (the objects are collected later as usual)."""
    global _TORCH
    if _TORCH is None:  # else imported and initialised (another thread waits in `import`)
        from .gcpause import paused_gc

        with paused_gc():
            import torch
        _TORCH = torch
    return _TORCH


_TORCH = None


_scratch = threading.local()  # each worker thread's cast buffers, reused across pieces


def _cast_buffers(isz: int, out_dtype):
    """This thread's input buffer (:data:`CAST_STEP` elements of ``isz`` bytes: a torch
    uint8 tensor, so never zero-filled) and output tensor (``out_dtype``), made once per
    thread and reused by every piece it casts: a fresh 4 MiB ``bytearray`` per piece was a
    memset of every buffer byte."""
    torch = _torch()

    key = (isz, out_dtype, CAST_STEP)
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    if key not in bufs:
        inbuf = torch.empty(CAST_STEP * isz, dtype=torch.uint8).numpy()
        out = torch.empty(CAST_STEP, dtype=out_dtype)
        bufs[key] = (inbuf, out, out.view(torch.uint8).numpy())
    return bufs[key]


def _cast_range(p: Piece, src: "_Sources", dst: int, pos: int, out_dtype: str,
                record=None) -> int:
    """Cast contiguous piece ``p`` (F32/F16/BF16) to ``out_dtype`` from its file to ``dst`` at
    byte ``pos``, :data:`CAST_STEP` elements at a time, with torch's own conversion
    (``Tensor.copy_`` into a reused buffer: the kernel ``Tensor.to`` runs, so the bits are
    ``.to()``'s: round to nearest even, NaN kept NaN; torch/aten/src/ATen/native/Copy.cpp).
    torch is imported for it (a cold plan imports it anyway for the architecture check; a
    warm one, core/archcache.py, does not: then the cast pays the import); its vectorised
    loop casts at memory speed where numpy's bit steps took 1.6x (bf16) and 3.4x (fp16) the
    keep-dtype merge. One intra-op thread per worker thread (an
    OpenMP setting of the calling thread, restored after): the workers are the parallelism.

    ``record``: the :class:`~.integrity.StorageRecord` that starts where the piece does (a
    local file; the record may run past the piece's end): its CRC-32 is computed here over the
    bytes just read, step by step (``zlib.crc32`` over the same buffer, still in the CPU
    cache; it releases the GIL), instead of the CRC checker reading the record a second
    time; a mismatch raises :func:`~.integrity.crc_error` (the merge's refusal naming the
    file, the record and its tensor) after the piece is written (into the temporary folder,
    which the refusal removes).

    Returns how many finite values the cast made ±Inf (out of ``out_dtype``'s range, as
    ``.to()`` makes them: :func:`~.cast.overflowed` on each step's buffers, two max reductions
    over the output words unless a step holds Inf or NaN)."""
    import warnings
    import zlib

    from .cast import can_overflow, overflowed
    from .dtypes import torch_dtype

    torch = _torch()
    isz, osz = ITEMSIZE[p.dtype], ITEMSIZE[out_dtype]
    n = p.numel
    local = src.local(p.file)  # else bytes come through src.read (another node's file)
    fd = src.fd(p.file) if local else None
    inbuf, out, out_bytes = _cast_buffers(isz, torch_dtype(out_dtype))
    in_dtype = torch_dtype(p.dtype)
    crc = over = 0
    narrows = can_overflow(p.dtype, out_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(0, n, CAST_STEP):
            k = min(CAST_STEP, n - i)
            if local:
                view = memoryview(inbuf)[:k * isz]
                _pread_exact(fd, k * isz, p.byte_offset + i * isz, p.file, view)
            else:
                view = memoryview(src.read(p.file, k * isz, p.byte_offset + i * isz))
            if record is not None:
                crc = zlib.crc32(view, crc)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only buffer: only read here
                x = torch.frombuffer(view, dtype=in_dtype, count=k)
            out[:k].copy_(x)
            if narrows:
                over += overflowed(view, p.dtype, out_bytes[:k * osz], out_dtype)
            _pwrite_all(dst, out_bytes[:k * osz], pos + i * osz)
    finally:
        torch.set_num_threads(threads)
    if record is not None:
        # the record's bytes past the piece (FSDP2 pads the last rank's shard: its storage is
        # longer than the rows it holds), read only for the CRC
        done = p.nbytes
        while done < record.size:
            k = min(COPY_CHUNK, record.size - done)
            crc = zlib.crc32(_pread_exact(fd, k, record.start + done, p.file), crc)
            done += k
        if crc != record.crc:
            from .integrity import crc_error

            raise crc_error(record)
    return over


def fused_records(plan: MergePlan, records: list, is_local) -> dict[tuple[str, int], object]:
    """The storage records whose CRC-32 the cast itself computes (:func:`_cast_range`), by
    (file, byte offset): each starts where one streamed-cast piece of a local file starts, holds
    it (its size at least the piece's; the bytes past it are read for the CRC alone) and is
    used by that tensor alone. The CRC checker skips them: the cast reads all their
    bytes anyway, so their check costs no second read. The conditions are those under which
    :meth:`_Writer.write_tensor` sends a piece to :func:`_cast_range` (keep them in step)."""
    by_start = {(r.file, r.start): r for r in records}
    fused: dict[tuple[str, int], object] = {}
    for of in plan.files:
        for t in of.tensors:
            rows = None  # _row_blocks(t), computed once per tensor and only when needed
            for p in t.pieces:
                r = by_start.get((p.file, p.byte_offset))
                if (r is None or p.nbytes > r.size or r.tensors != [t.name]
                        or t.fold is not None or not p.contiguous or p.dtype == t.dtype
                        or not {p.dtype, t.dtype} <= {"F32", "F16", "BF16"}
                        or not is_local(p.file)):
                    continue
                if rows is None:
                    rows = _row_blocks(t)
                if rows:
                    fused[(p.file, p.byte_offset)] = r
    return fused


def _pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of the output file ``fd``; a failure (disk full,
    quota, file size limit) is the output's: :class:`OutputWriteError` (its path is filled in
    by :func:`_writing`)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done:done + COPY_CHUNK], offset + done)
        except OSError as e:
            raise OutputWriteError(e.strerror or str(e)) from None


class _writing:
    """Context for writing the output file ``rel`` of the output folder ``out``: an
    ``OSError`` there (ENOSPC, EDQUOT, EFBIG, EROFS, EIO) becomes one
    :class:`OutputWriteError` naming ``out`` and ``rel`` (exit 2: the checkpoint is not to
    blame; the temporary folder is removed by :func:`run_merge`)."""

    def __init__(self, out: Path, rel: str):
        self.out, self.rel = out, rel

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if isinstance(exc, OutputWriteError) and exc.path is None:
            raise OutputWriteError(f"cannot write {self.rel}: {exc.message}; nothing was "
                                   "written", str(self.out)) from None
        if isinstance(exc, OSError) and (exc.filename is None or TMP_MARK in str(exc.filename)):
            raise OutputWriteError(f"cannot write {self.rel}: {exc.strerror or exc}; nothing "
                                   "was written", str(self.out)) from None
        return False


def _copy_into(src: str, dst: Path, out: Path, rel: str) -> None:
    """Copy the checkpoint's file ``src`` to ``dst`` (the output's ``rel``): a failure to read
    blames ``src`` (:class:`BadCheckpointError`), a failure to write the output
    (:class:`OutputWriteError`)."""
    try:
        fin = open(src, "rb")
    except OSError as e:
        raise BadCheckpointError(f"cannot copy: {e.strerror}", src) from None
    with fin, _writing(out, rel), open(dst, "wb") as fout:
        while True:
            try:
                chunk = fin.read(1 << 20)
            except OSError as e:
                raise BadCheckpointError(f"cannot copy: {e.strerror}", src) from None
            if not chunk:
                break
            fout.write(chunk)


def _copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int, path: str) -> None:
    """Copy ``n`` bytes between files at the given offsets, in the kernel where it can."""
    done = 0
    while done < n:
        k = min(COPY_CHUNK, n - done)
        try:
            c = os.copy_file_range(src, dst, k, src_off + done, dst_off + done)
        except OSError:
            c = -1
        if c <= 0:  # not supported here (or EOF): fall back to read + write
            _pwrite_all(dst, _pread_exact(src, k, src_off + done, path), dst_off + done)
            c = k
        done += c


def _span(p: Piece) -> int:
    """Elements from the piece's first to its last element in storage (its strided extent)."""
    if p.numel == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(p.shape, p.stride))


def _piece_bytes(p: Piece, src: _Sources):
    """The piece's elements in C order as bytes (a numpy uint8 array; reads its strided
    extent once, copies only when the piece is not contiguous)."""
    import numpy as np

    size = ITEMSIZE[p.dtype]
    if p.contiguous:
        return np.frombuffer(src.read(p.file, p.nbytes, p.byte_offset),
                             dtype=np.uint8)
    n = _span(p)
    word = np.dtype(f"<u{size}")
    buf = np.frombuffer(src.read(p.file, n * size, p.byte_offset),
                        dtype=word, count=n)
    part = np.lib.stride_tricks.as_strided(buf, p.shape, [st * size for st in p.stride])
    return np.ascontiguousarray(part).reshape(-1).view(np.uint8)


def _piece_tensor(p: Piece, src: _Sources):
    """The piece as a torch tensor (reads its bytes)."""
    import warnings

    import torch

    from .dtypes import torch_dtype

    n = _span(p)
    if n == 0:
        return torch.empty(p.shape, dtype=torch_dtype(p.dtype))
    buf = src.read(p.file, n * ITEMSIZE[p.dtype], p.byte_offset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(buf, dtype=torch_dtype(p.dtype), count=n)
    return flat.as_strided(p.shape, p.stride)


def assemble(pieces: list[Piece], shape: tuple[int, ...], dtype: str, src: _Sources,
             flat: bool = False):
    """The full tensor (torch, ``dtype``) filled from its located ``pieces``; with ``flat``
    the pieces are ranges of the flattened tensor (:func:`assemble_bytes`, viewed as
    ``dtype``)."""
    import torch

    from .dtypes import torch_dtype

    return torch.from_numpy(assemble_bytes(pieces, shape, dtype, src, flat)).view(
        torch_dtype(dtype))


def assemble_bytes(pieces: list[Piece], shape: tuple[int, ...], dtype: str, src: _Sources,
                   flat: bool = False):
    """The full tensor as a numpy array of unsigned integers as wide as ``dtype``'s elements
    (the bit patterns, never converted), filled from its located ``pieces`` (strided views
    allowed); with ``flat`` the pieces are ranges of the flattened tensor."""
    import numpy as np

    size = ITEMSIZE[dtype]
    word = np.dtype(f"<u{size}")
    full = np.empty(shape, dtype=word)
    view = full.reshape(-1) if flat else full
    for p in pieces:
        if p.numel == 0:
            continue
        n = _span(p)
        buf = np.frombuffer(src.read(p.file, n * size, p.byte_offset),
                            dtype=word, count=n)
        part = np.lib.stride_tricks.as_strided(buf, p.shape, [st * size for st in p.stride])
        view[tuple(slice(o, o + k) for o, k in zip(p.global_offsets, p.shape))] = part
    return full


def fold_lora(w, a, b, scale: float, out_dtype, kind: str = "linear", magnitude=None):
    """One adapter folded into weight ``w`` with peft's own operations and dtypes, so the
    result equals ``merge_and_unload`` bit for bit (peft 0.21 ``tuners/lora/layer.py``
    ``Linear.merge``/``Embedding.merge``/``get_delta_weight``, ``tuners/lora/variants.py``
    ``DoraLinearVariant.merge_unsafe``, ``tuners/lora/dora.py`` ``get_weight_norm``):

    - the delta is ``(B @ A) * scale`` (``linear``) or ``(B @ A).T * scale`` (``embedding``)
      in the adapter's dtype; a bf16/fp16 adapter is multiplied in float32 and the delta cast
      back to the adapter's dtype (peft does so on the CPU);
    - ``linear``: ``W += delta`` in place (a bf16 weight plus an fp32 delta rounds once);
      ``embedding``: ``W += delta.to(W.dtype)``;
    - ``dora``: ``norm = ||W + delta||`` per row (``torch.linalg.norm(dim=1)``, in the sum's
      dtype), ``W' = (magnitude / norm).view(-1, 1) * (W + delta)`` cast to ``W``'s dtype.

    Then cast to ``out_dtype`` (``--dtype``). Shapes: ``w`` (out, in), ``a`` (r, in), ``b``
    (out, r); for ``embedding`` ``w`` (num_embeddings, dim), ``a`` (r, num_embeddings),
    ``b`` (dim, r); ``magnitude`` (out,)."""
    import torch

    lora_dtype = a.dtype if kind == "embedding" else b.dtype
    cast = lora_dtype in (torch.float16, torch.bfloat16)
    if cast:
        a, b = a.float(), b.float()
    delta = ((b @ a).T if kind == "embedding" else b @ a) * scale
    if cast:
        delta = delta.to(dtype=lora_dtype)
    w = w.clone()
    if kind == "embedding":
        w += delta.to(w.dtype)
    elif kind == "dora":
        summed = w + 1 * delta
        norm = torch.linalg.norm(summed, dim=1).to(summed.dtype)
        factor = (magnitude / norm).view(-1, 1)
        w = (factor * (w + delta)).to(w.dtype)
    else:
        w += delta
    return w.to(out_dtype)


def _overflowed_t(x, src: str, y, dst: str) -> int:
    """:func:`~.cast.overflowed` of torch tensors: ``x`` (``src`` elements) and ``y``, its
    cast to ``dst`` (``x``'s words are counted only when ``y`` holds an Inf)."""
    from .cast import can_overflow, overflowed

    if not can_overflow(src, dst):
        return 0
    import torch

    def words(v):
        return v.contiguous().reshape(-1).view(torch.uint8).numpy()

    return overflowed(words(x), src, words(y), dst)


def _row_blocks(t: OutputTensor) -> bool:
    """True when the pieces are whole rows (every dim but the first complete) that follow each
    other: then the output bytes are the pieces' bytes in order."""
    shape = t.source.piece_shape
    pos = 0
    for p in t.pieces:
        if tuple(p.shape[1:]) != tuple(shape[1:]) or any(p.global_offsets[1:]):
            return False
        if p.global_offsets[:1] and p.global_offsets[0] != pos:
            return False
        pos += p.shape[0] if p.shape else 1
    return pos == (shape[0] if shape else 1)


class _Writer:
    def __init__(self, plan: MergePlan, on_progress, cancel: threading.Event, log,
                 sources: _Sources | None = None):
        self.plan, self.on_progress, self.cancel, self.log = plan, on_progress, cancel, log
        self.src = sources or _Sources()
        self.lock = threading.Lock()
        self.written = 0
        self.done = 0
        self.read: dict[str, int] = {}
        self.total = plan.total_bytes
        self.count = plan.tensor_count
        #: records whose CRC-32 the cast computes (:func:`fused_records`), by (file, offset)
        self.fused: dict[tuple[str, int], object] = {}
        #: tensor name -> how many finite values its cast made ±Inf (none: not listed)
        self.overflow: dict[str, int] = {}

    def _report(self, piece: Piece | None, nbytes: int, tensor: str = "", ofile: str = ""):
        with self.lock:
            self.written += nbytes
            if tensor:
                self.done += 1
            src = piece.file if piece else ""
            if piece:
                self.read[src] = self.read.get(src, 0) + piece.nbytes
            ev = MergeProgress(self.written, self.total, self.done, self.count, src,
                               self.read.get(src, 0), self.plan.source_bytes.get(src, 0),
                               tensor, ofile)
        if self.on_progress:
            self.on_progress(ev)

    def write_tensor(self, t: OutputTensor, dst: int, offset: int, ofile: str) -> None:
        if self.cancel.is_set():
            raise MergeCancelled("merge cancelled")
        from .cast import overflowed
        from .dtypes import torch_dtype

        over = 0  # finite values the cast made ±Inf
        if t.fold is not None:
            f = t.fold
            w = assemble(t.pieces, t.shape, t.source.dtype, self.src, t.source.flat)
            a = assemble(f.a_pieces, f.a.shape, f.a.dtype, self.src, f.a.flat)
            b = assemble(f.b_pieces, f.b.shape, f.b.dtype, self.src, f.b.flat)
            m = (assemble(f.m_pieces, f.magnitude.shape, f.magnitude.dtype, self.src,
                          f.magnitude.flat) if f.magnitude is not None else None)
            # folded in the weight's dtype (as peft does), then cast here to count overflows
            folded = fold_lora(w, a, b, f.scale, w.dtype, f.kind, m).contiguous()
            x = folded.to(torch_dtype(t.dtype)).contiguous()
            over = _overflowed_t(folded, t.source.dtype, x, t.dtype)
            import torch

            _pwrite_all(dst, x.reshape(-1).view(torch.uint8).numpy(), offset)
            for p in (*t.pieces, *f.a_pieces, *f.b_pieces, *f.m_pieces):
                self._report(p, 0)
            self._report(None, t.nbytes)
        elif _row_blocks(t):
            pos = offset
            for p in t.pieces:
                if self.cancel.is_set():
                    raise MergeCancelled("merge cancelled")
                out_bytes = p.numel * ITEMSIZE[t.dtype]
                if p.dtype == t.dtype and p.contiguous and self.src.local(p.file):
                    _copy_range(self.src.fd(p.file), dst, p.nbytes, p.byte_offset, pos, p.file)
                elif p.contiguous and {p.dtype, t.dtype} <= {"F32", "F16", "BF16"}:
                    # streamed: bounded memory; the record's CRC-32 on the way when fused
                    over += _cast_range(p, self.src, dst, pos, t.dtype,
                                        self.fused.get((p.file, p.byte_offset)))
                elif p.dtype == t.dtype or {p.dtype, t.dtype} <= {"F32", "F16", "BF16"}:
                    # numpy, not torch: same bits, and no 2 s torch import for a cast or a
                    # strided piece (e.g. q/k rows permuted by core/native_names.py)
                    from .cast import cast_bytes

                    buf = _piece_bytes(p, self.src)
                    if p.dtype != t.dtype:
                        raw, buf = buf, cast_bytes(buf, p.dtype, t.dtype)
                        over += overflowed(raw, p.dtype, buf, t.dtype)
                    _pwrite_all(dst, buf, pos)
                else:
                    import torch

                    y = _piece_tensor(p, self.src)
                    x = y.to(torch_dtype(t.dtype)).contiguous()
                    over += _overflowed_t(y, p.dtype, x, t.dtype)
                    _pwrite_all(dst, x.reshape(-1).view(torch.uint8).numpy(), pos)
                pos += out_bytes
                self._report(p, out_bytes)
        elif t.dtype == t.source.dtype or {t.source.dtype, t.dtype} <= {"F32", "F16", "BF16"}:
            # pieces in boxes (e.g. TP Shard(1) columns): placed by numpy as raw elements of
            # the same width, so no torch import and no conversion; then a cast if asked
            full = assemble_bytes(t.pieces, t.shape, t.source.dtype, self.src, t.source.flat)
            for p in t.pieces:
                self._report(p, 0)
            if t.dtype != t.source.dtype:
                from .cast import cast_bytes

                raw = full.reshape(-1).view("u1")
                full = cast_bytes(raw, t.source.dtype, t.dtype)
                over = overflowed(raw, t.source.dtype, full, t.dtype)
            _pwrite_all(dst, full.reshape(-1).view("u1"), offset)
            self._report(None, t.nbytes)
        else:
            import torch

            whole = assemble(t.pieces, t.shape, t.source.dtype, self.src, t.source.flat)
            for p in t.pieces:
                self._report(p, 0)
            full = whole.to(torch_dtype(t.dtype)).contiguous()
            over = _overflowed_t(whole, t.source.dtype, full, t.dtype)
            _pwrite_all(dst, full.reshape(-1).view(torch.uint8).numpy(), offset)
            self._report(None, t.nbytes)
        if over:
            with self.lock:
                self.overflow[t.name] = self.overflow.get(t.name, 0) + over
        self._report(None, 0, t.name, ofile)
        if self.log:
            self.log(f"wrote {t.name} {list(t.shape)} {t.dtype} ({len(t.pieces)} pieces) "
                     f"to {ofile}")


def run_merge(plan: MergePlan, on_progress: Callable[[MergeProgress], None] | None = None,
              cancel: threading.Event | None = None,
              log: Callable[[str], None] | None = None,
              sources: _Sources | None = None, pending=None) -> MergeResult:
    """Write the planned Hugging Face folder.

    ``on_progress`` is called from worker threads (make it thread-safe); ``cancel`` is checked
    between tensors and pieces; ``log`` receives one line per step (for ``--verbose``).
    Raises :class:`MergeCancelled` when cancelled, :class:`BadCheckpointError` on a read
    failure, :class:`OutputExistsError` when the output appeared meanwhile; in every case the
    temporary folder is removed and nothing is left at the output (a KeyboardInterrupt too,
    up to the commit: the rename into place and a last check of ``cancel``; a replaced
    output is then back as it was). An interrupt after the commit does not undo the merge:
    ``cancel`` is then set on return. ``sources``: where source bytes are read (default:
    local files; core/distributed.py passes one that fetches the pieces other nodes hold).
    ``pending``: ``plan`` is speculative (core/overlap.py): once its tensor files are written
    the real plan is taken from ``pending`` (``PlanChanged`` when it writes other tensor
    files) and writes the rest; the writing stops early when the real plan is known to
    differ.
    """
    cancel = cancel or threading.Event()
    user_cancel = cancel
    if pending is not None:
        from .overlap import StopWhenStale

        cancel = StopWhenStale(user_cancel, pending)
    opts = plan.options
    out = Path(opts.output)
    from .plan import recover_set_aside

    recovered = recover_set_aside(out, opts.overwrite)  # a plan made before it was left
    check_output(out, opts.overwrite, plan.layout.path)
    warnings = list(plan.warnings) + ([recovered] if recovered else [])
    for stale in stale_temp_dirs(out):
        shutil.rmtree(stale, ignore_errors=True)
        warnings.append(f"removed {stale}, left by an interrupted merge")
    tmp = temp_dir_for(out)
    t0 = time.perf_counter()
    w = _Writer(plan, on_progress, cancel, log, sources)
    checker, crc_records, unchecked = None, [], []
    # one try from the folder's creation on: an interrupt that lands as mkdir returns (or in
    # the CRC listing, which takes a while) removes ``tmp`` too
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            raise UsageError(f"cannot write beside the output: {e.strerror}",
                             str(out)) from None
        if getattr(opts, "crc", True):
            from .integrity import CrcChecker, plan_records

            crc_records, unchecked = plan_records(plan, w.src.local)
            w.fused = fused_records(plan, crc_records, w.src.local)
            rest = [r for r in crc_records if (r.file, r.start) not in w.fused]
            if rest:  # in its own thread, overlapping the writing
                checker = CrcChecker(rest, cancel, min(4, max(1, opts.workers)))
                checker.start()
        written = []
        with ThreadPoolExecutor(max(1, opts.workers), thread_name_prefix="shardscope") as pool:
            for of in plan.files:
                fpath = tmp / of.name
                fpath.parent.mkdir(parents=True, exist_ok=True)
                header = safetensors_header(of.tensors)
                with _writing(out, of.name):
                    fd = os.open(fpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        _pwrite_all(fd, header, 0)
                        os.ftruncate(fd, len(header) + of.nbytes)
                        pos = len(header)
                        futures = []
                        for t in of.tensors:
                            futures.append(pool.submit(w.write_tensor, t, fd, pos, of.name))
                            pos += t.nbytes
                            # bound memory: at most ~2 tensors per worker in flight
                            if len(futures) >= 2 * max(1, opts.workers):
                                _drain(futures, cancel, keep=max(1, opts.workers))
                        _drain(futures, cancel, keep=0)
                    finally:
                        os.close(fd)
                written.append((of.name, len(header) + of.nbytes))
                if log:
                    log(f"closed {of.name} ({len(header) + of.nbytes} bytes)")
        if pending is not None:  # the rest as the real plan says, when it writes the same
            spec, plan = plan, pending.confirm(plan, user_cancel)
            warnings = list(plan.warnings) + warnings[len(spec.warnings):]
        if w.overflow:
            warnings.append(overflow_warning(w.overflow, opts.dtype))
        if plan.index is not None:
            with _writing(out, "model.safetensors.index.json"):
                (tmp / "model.safetensors.index.json").write_text(
                    json.dumps(plan.index, indent=2) + "\n")
        for rel, data in plan.generated.items():
            with _writing(out, rel):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
        for src, rel in plan.copy_files:
            dst = tmp / rel
            with _writing(out, rel):
                dst.parent.mkdir(parents=True, exist_ok=True)
            if rel == "config.json" and plan.config_dtype:
                try:
                    text = Path(src).read_text()
                except (OSError, UnicodeDecodeError) as e:
                    raise BadCheckpointError(f"cannot copy: {getattr(e, 'strerror', None) or e}",
                                             src) from None
                with _writing(out, rel):
                    _write_config_dtype(text, dst, plan.config_dtype)
            else:
                _copy_into(src, dst, out, rel)
            if log:
                log(f"copied {rel}")
        if checker is not None:
            checker.result()  # raises when a record fails its CRC-32
        if cancel.is_set():
            raise MergeCancelled("merge cancelled")
        trash = _move_into_place(tmp, out, opts.overwrite, cancel)
    except BaseException as e:
        cancel.set()  # stop workers still running
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            if checker is not None and isinstance(e, MergeCancelled):
                checker.result()  # the writer stopped because a record failed its CRC-32
        finally:
            w.src.close()
        raise
    # committed: the merge is at ``out``; an interrupt from here on does not undo it: it sets
    # ``cancel`` (a caller can tell that it came after the merge was written) and the tidying
    # is finished
    try:
        _tidy(w.src, trash)
    except KeyboardInterrupt:
        user_cancel.set()
        _tidy(w.src, trash)
    return MergeResult(str(out), written, plan.total_bytes, time.perf_counter() - t0,
                       plan.tensor_count, warnings, len(crc_records), unchecked)


#: tensors an overflow warning names (then "and N more")
OVERFLOW_NAMED = 10


def overflow_warning(counts: dict[str, int], dtype: str | None) -> str:
    """The merge's one warning about a cast that made finite values ±Inf: ``counts`` maps
    each such tensor to how many (finite in the checkpoint, Inf in the output), ``dtype`` is
    ``--dtype`` as given. The output is ``.to()``'s all the same (that is the cast's
    definition); the warning names the tensors, in name order, with their counts."""
    from .plan import natural_key

    names = sorted(counts, key=natural_key)
    listed = ", ".join(f"{n} ({counts[n]})" for n in names[:OVERFLOW_NAMED])
    more = len(names) - OVERFLOW_NAMED
    total = sum(counts.values())
    return (f"--dtype {dtype}: {total} finite value{'s' if total != 1 else ''} out of "
            f"{dtype}'s range became ±Inf (as torch's .to() makes them) in {len(names)} "
            f"tensor{'s' if len(names) != 1 else ''}: {listed}"
            + (f" and {more} more" if more > 0 else ""))


def _tidy(src, trash: Path | None) -> None:
    """After the commit: close the source files, remove the replaced output (if any)."""
    src.close()
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _write_config_dtype(text: str, dst: Path, dtype: str) -> None:
    """Write config.json (its text ``text``) with its ``dtype``/``torch_dtype`` set to the
    cast dtype, so ``from_pretrained`` loads the model in the dtype it was written in."""
    try:
        cfg = json.loads(text)
    except ValueError:
        cfg = None
    if not isinstance(cfg, dict):  # not ours to fix: copy it as it is
        dst.write_text(text)
        return
    for key in ("dtype", "torch_dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = dtype
    dst.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _drain(futures: list, cancel: threading.Event, keep: int) -> None:
    """Wait until at most ``keep`` futures are pending; re-raise the first failure."""
    while len(futures) > keep:
        done, _ = wait(futures[: len(futures) - keep], return_when=FIRST_EXCEPTION)
        for f in done:
            exc = f.exception()
            if exc is not None:
                cancel.set()
                raise exc
        futures[:] = [f for f in futures if f not in done]


def _move_into_place(tmp: Path, out: Path, overwrite: bool,
                     cancel: threading.Event) -> Path | None:
    """Publish the finished folder ``tmp`` at ``out`` (an existing ``out`` first renamed
    aside, with ``overwrite``). Returns that old folder, for the caller to remove once the
    merge is committed, or None. The commit point is the last check of ``cancel`` after the
    renames: an interrupt before it (KeyboardInterrupt raised between any two steps, or
    ``cancel`` set meanwhile) undoes the renames, judged from the folders themselves
    (``tmp`` is gone only once renamed to ``out``), so the old ``out`` is back, ``tmp`` holds
    the new folder (removed by the caller) and the exception propagates."""
    trash = None
    try:
        if out.exists():
            check_output(out, overwrite)
            trash = out.parent / f".{out.name}{TMP_MARK}old-{os.getpid()}"
            os.rename(out, trash)
        os.rename(tmp, out)
        if cancel.is_set():
            raise MergeCancelled("merge cancelled")
    except BaseException:
        if not tmp.exists() and out.exists():
            os.rename(out, tmp)
        if trash is not None and trash.exists() and not out.exists():
            os.rename(trash, out)
        raise
    return trash
