"""A restricted reader of ``torch.save`` archives that never imports torch and never runs code.

Why our own reader rather than ``torch.load``: inspection must be fast (no torch import, no
tensor data read) and must give the byte offset of every storage inside the file so the merge
can stream from mmap; and checkpoints are untrusted input, so every global a pickle names is
checked against an allow-list of data-only records before anything is built.

Format facts (torch/serialization.py, checked on files written by torch 2.13): the file is a
zip with every entry stored uncompressed: ``<name>/data.pkl`` (the pickle), ``<name>/data/<key>``
(one entry per storage), ``<name>/byteorder``. The pickle refers to storages by persistent id
``('storage', <StorageClass>, key, location, numel)``; tensors are rebuilt by
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, ...)``, or for the
dtypes of torch/storage.py ``_new_dtypes()`` (float8, uint16/32/64 ...) by
``torch._utils._rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad,
backward_hooks, dtype[, metadata])`` over an ``UntypedStorage`` (numel in bytes; the offset
counts elements of ``dtype``: torch/_tensor.py ``_reduce_ex_internal``); DTensors by
``torch._tensor._rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, args, state)`` with
``state = {'_local_tensor': ..., '_spec': DTensorSpec}``; ShardedTensors by NEWOBJ + BUILD
with state ``(local_shards, metadata, ...)``.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import STORAGE_DTYPES, TORCH_DTYPE_NAMES, UNSUPPORTED_TORCH_DTYPES
from ..errors import BadCheckpointError, UnsafeCheckpointError


@dataclass
class StorageRef:
    """A storage entry of the archive: ``key`` (entry name), dtype, element count, and once
    resolved, the absolute byte offset of its data in the file and its length in bytes."""

    key: str
    dtype: str
    numel: int
    location: str = "cpu"
    data_offset: int = -1
    data_bytes: int = -1


@dataclass
class TensorRef:
    """A plain tensor: a strided view of a storage (shape/stride/storage_offset in elements)."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: the tensor's dtype when it differs from its storage's (``_rebuild_tensor_v3`` over an
    #: untyped byte storage)
    view_dtype: str | None = None

    @property
    def dtype(self) -> str:
        return self.view_dtype or self.storage.dtype

    @property
    def byte_offset(self) -> int:
        from ..dtypes import ITEMSIZE

        return self.storage.data_offset + self.storage_offset * ITEMSIZE[self.dtype]

    def fits_storage(self) -> bool:
        """True when the view is well-formed and lies inside its storage (a damaged pickle
        may say otherwise)."""
        if len(self.shape) != len(self.stride) or any(
                not isinstance(x, int) or x < 0 for x in (*self.shape, *self.stride)):
            return False
        if any(s == 0 for s in self.shape):
            return True
        from ..dtypes import ITEMSIZE

        last = self.storage_offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        size = ITEMSIZE.get(self.dtype)
        if size is None or not isinstance(self.storage.numel, int):
            return False
        # the storage counts elements of its own dtype (bytes for an untyped storage)
        n = self.storage.numel * ITEMSIZE.get(self.storage.dtype, 1) // size
        return self.storage_offset >= 0 and last < n


@dataclass(eq=False)
class Record:
    """Any other allowed object, kept as data: the global it names, the arguments it was
    called with, and its pickled state."""

    module: str
    name: str
    args: tuple = ()
    state: Any = None
    attrs: dict = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """A field of the pickled state (dict state, or dict inside a (dict, slots) pair)."""
        st = self.state
        if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict):
            if key in st[1]:
                return st[1][key]
            st = st[0]
        if isinstance(st, dict):
            return st.get(key, default)
        return default


@dataclass
class DType:
    """A ``torch.<dtype>`` global, as its safetensors name (``unsupported:<torch name>`` for
    a dtype with no safetensors name, see ``dtypes.UNSUPPORTED_TORCH_DTYPES``)."""

    name: str


UNSUPPORTED_PREFIX = "unsupported:"


# Globals a model checkpoint may name, each mapped to a data-only record. Private module paths
# move between torch releases; everything under these prefixes is a plain data class.
_RECORD_MODULES = (
    "torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed.device_mesh",
    "torch.distributed._mesh_layout", "torch.distributed._shard", "torch.distributed.remote_device",
    "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._extension", "torch.distributed.checkpoint.planner",
    # DeepSpeed's checkpoint records (loss scaler, ZeRO stage enum, fragment addresses): read
    # as data, never imported
    "deepspeed.runtime", "deepspeed.utils", "deepspeed.checkpoint",
    # Megatron-LM's enums inside ``args`` (e.g. AttnBackend), read as data, never imported
    "megatron",
)

# Single globals of a Megatron-LM checkpoint that are data too: ``args`` is an
# argparse.Namespace; ``rng_state`` holds numpy's generator state (an ndarray, pickled through
# numpy's reconstructor and ``_codecs.encode``). Kept as records, never called.
_RECORD_GLOBALS = frozenset({
    ("argparse", "Namespace"), ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
})


#: typed storage classes of dtypes with no safetensors name (torch/storage.py
#: ``_dtype_to_storage_type_map``)
UNSUPPORTED_STORAGES = {"ComplexDoubleStorage": "complex128", "QInt8Storage": "qint8",
                        "QInt32Storage": "qint32", "QUInt8Storage": "quint8",
                        "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4"}


class StateDict(dict):
    """``collections.OrderedDict`` as a state dict pickles it: a dict plus attributes set by
    BUILD (``_metadata``), kept in ``attrs``."""

    def __setstate__(self, state):
        self.attrs = state


def _make_record_class(module: str, name: str):
    """A class whose ``__new__`` (pickle NEWOBJ) and call (REDUCE) both give a Record."""

    def __new__(cls, *args):
        return Record(module, name, args)

    return type(name, (), {"__new__": __new__, "_record": (module, name)})


def _setstate(rec: Record, state: Any) -> None:
    rec.state = state


Record.__setstate__ = _setstate  # BUILD on a Record stores the state as data


def _rebuild_tensor_v2(storage, storage_offset, size, stride, *_rest):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, _requires_grad, _hooks, dtype,
                       *_rest):
    if not isinstance(dtype, DType):
        raise BadCheckpointError(f"_rebuild_tensor_v3 with dtype {dtype!r}")
    if dtype.name.startswith(UNSUPPORTED_PREFIX):
        raise BadCheckpointError(f"holds a torch.{dtype.name[len(UNSUPPORTED_PREFIX):]} tensor, "
                                 "a dtype safetensors cannot hold (unsupported)",
                                 code="unsupported-dtype")
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride), dtype.name)


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, *_rest):
    return Record("wrapper", getattr(cls, "_record", ("", "?"))[1],
                  (dtype, tuple(size), tuple(stride), storage_offset))


def _rebuild_from_type_v2(func, new_type, args, state):
    obj = func(*args)
    if isinstance(obj, TensorRef):
        return obj  # a plain tensor (or Parameter) with Python attributes: keep the data view
    if isinstance(obj, Record):
        obj.state = state
        mod, name = getattr(new_type, "_record", ("", ""))
        obj.module, obj.name = mod or obj.module, name or obj.name
    return obj


def _getattr(obj, name):
    # FSDP1 ShardedTensor metadata names an enum member as getattr(MEM_FORMAT_ENCODING, NAME).
    if isinstance(obj, type) and hasattr(obj, "_record"):
        return _make_record_class(obj._record[0], f"{obj._record[1]}.{name}")
    raise UnsafeCheckpointError(f"pickle calls getattr on {obj!r}")


_FUNCTIONS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.serialization", "_get_layout"): lambda name: name,
    ("torch._utils", "_rebuild_parameter"): lambda data, *_: data,
    ("torch._utils", "_rebuild_parameter_with_state"): lambda data, *_: data,
    ("torch", "Tensor"): _make_record_class("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"): _make_record_class("torch.nn.parameter", "Parameter"),
    ("torch", "device"): lambda *a: str(a[0]) if a else "cpu",
    ("torch", "Size"): lambda *a: tuple(a[0]) if a else (),
    ("collections", "OrderedDict"): StateDict,
    ("builtins", "getattr"): _getattr,
    ("__builtin__", "getattr"): _getattr,
    ("builtins", "set"): set,
    ("pathlib", "PosixPath"): lambda *a: "/".join(map(str, a)),
    ("pathlib", "PurePosixPath"): lambda *a: "/".join(map(str, a)),
    ("pathlib", "WindowsPath"): lambda *a: "/".join(map(str, a)),
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("argparse", "Namespace"): _make_record_class("argparse", "Namespace"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint pickle into plain records. Raises
    :class:`UnsafeCheckpointError` for any global outside the allow-list (e.g. ``os.system``).

    The C unpickler: the pure-Python one took 2 s more to inspect 64 rank files. Its one
    weakness here is a memo array sized by the ``LONG_BINPUT`` index a pickle names: a file
    crafted with a huge index costs memory (never code execution). Random damage does not
    reach it: ``zipfile`` checks the CRC-32 of ``data.pkl`` before we unpickle it."""

    def __init__(self, file, path: str, storages: dict[str, StorageRef]):
        super().__init__(file)
        self.path = path
        self.storages = storages

    def find_class(self, module: str, name: str):
        fn = _FUNCTIONS.get((module, name))
        if fn is not None:
            return fn
        if module == "torch" and name.endswith("Storage") and name in STORAGE_DTYPES:
            return ("storage-class", STORAGE_DTYPES[name])
        if (module, name) == ("torch.storage", "UntypedStorage"):  # the v3 byte storage
            return ("storage-class", "U8")
        if module == "torch" and name in TORCH_DTYPE_NAMES:
            return DType(TORCH_DTYPE_NAMES[name])
        if module == "torch" and name in UNSUPPORTED_TORCH_DTYPES:
            return DType(UNSUPPORTED_PREFIX + name)
        if module == "torch" and name in UNSUPPORTED_STORAGES:
            raise BadCheckpointError(f"holds a torch.{UNSUPPORTED_STORAGES[name]} tensor, a "
                                     "dtype safetensors cannot hold (unsupported)", self.path,
                                     code="unsupported-dtype")
        if module == "torch" and name in ("contiguous_format", "preserve_format",
                                          "channels_last", "strided"):
            return name
        if (module, name) in _RECORD_GLOBALS or any(
                module == m or module.startswith(m + ".") for m in _RECORD_MODULES):
            return _make_record_class(module, name)
        raise UnsafeCheckpointError(
            f"pickle names the global {module}.{name}, which is not a tensor record; refusing to "
            "load it (it could run code)", self.path)

    def persistent_load(self, pid):
        # zip archives: ('storage', cls, key, location, numel); the legacy (non-zip) format
        # adds view metadata, None for a whole storage (torch/serialization.py _legacy_save)
        if not (isinstance(pid, tuple) and pid[:1] == ("storage",) and (
                len(pid) == 5 or (len(pid) == 6 and pid[5] is None))):
            raise BadCheckpointError(f"unexpected persistent id {pid!r}", self.path)
        _, cls, key, location, numel = pid[:5]
        dtype = cls[1] if isinstance(cls, tuple) else "U8"
        ref = self.storages.get(key)
        if ref is None:
            ref = StorageRef(str(key), dtype, int(numel), str(location))
            self.storages[key] = ref
        return ref


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of a file starting at ``base``."""

    def __init__(self, f, base: int, length: int):
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, off, whence=0):
        pos = off if whence == 0 else self.pos + off if whence == 1 else self.length + off
        if pos < 0:  # a damaged zip directory can point before the archive
            raise ValueError("seek before the start of the archive")
        self.pos = pos
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass
class TorchArchive:
    """The unpickled root object of a ``torch.save`` archive with resolved storage offsets.

    When the caller's ``reuse`` hook recognised the pickle (:func:`read_torch_archive`),
    ``root`` is what the hook returned, ``storages`` is empty and ``offsets`` maps each storage
    key the hook named to the absolute byte offset of its data in the file."""

    path: str
    root: Any
    storages: dict[str, StorageRef]
    offsets: dict[str, int] | None = None


def read_torch_archive(path: str, base: int = 0, length: int | None = None,
                       reuse=None, directories: "DirectoryCache | None" = None
                       ) -> TorchArchive:
    """Read the pickle of the ``torch.save`` archive at ``path`` (or the ``length`` bytes at
    ``base`` of it, as DCP embeds one per chunk) and locate every storage's bytes.

    ``reuse(pickle_bytes)``, when given, may return ``(root, storages)`` for a pickle it
    recognises (rank files of one run pickle the same state dict but for a few values), where
    ``storages`` is a list of ``(key, bytes its tensors need)``: the pickle is then not
    unpickled again, but the archive's directory, the pickle's CRC-32, every named storage's
    entry and local header, its size and its extent inside the file are checked as usual, and
    the result has ``offsets`` instead of ``storages``. ``reuse`` returns None to unpickle.
    ``directories``: the zip directories of the files read before (with ``reuse``), to
    recognise this file's (:class:`DirectoryCache`).

    Raises :class:`BadCheckpointError` when the file is not a readable archive or a storage
    entry is missing, compressed or short; :class:`UnsafeCheckpointError` for a forbidden global.
    """
    try:
        return _read_archive(path, base, length, reuse, directories)
    except (BadCheckpointError, UnsafeCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged zip directory can raise anything
        raise BadCheckpointError(f"corrupt torch.save archive ({type(e).__name__}: {e})",
                                 path) from None


class _Entry(tuple):
    """One central-directory entry of a zip archive (offsets relative to the archive start):
    a plain tuple (filename, compress_type, CRC, file_size, compress_size, header_offset)."""

    __slots__ = ()
    filename = property(lambda self: self[0])
    compress_type = property(lambda self: self[1])
    CRC = property(lambda self: self[2])
    file_size = property(lambda self: self[3])
    compress_size = property(lambda self: self[4])
    header_offset = property(lambda self: self[5])


_EOCD = struct.Struct("<4s4H2LH")
_Z64_LOCATOR = struct.Struct("<4sLQL")
_Z64_EOCD = struct.Struct("<4sQ2H2L4Q")
#: central directory entry: signature, flags, method, CRC-32, sizes, name/extra/comment
#: lengths, local header offset (the fields between are skipped)
_CDIR = struct.Struct("<4s4xHH4xLLLHHH8xL")


def _fast_directory(mm, base: int, length: int) -> list[_Entry] | None:
    """The central directory of the zip archive in ``mm[base:base+length]`` parsed with
    ``struct`` in one pass (APPNOTE.TXT 4.3.12-4.3.16; torch's writer, miniz, always adds the
    zip64 end records), or None when it is anything but the plain layout torch writes (an
    archive comment, split disks, zip64 fields inside entries, data before the archive):
    the caller then falls back to :mod:`zipfile`. ``zipfile`` builds a ZipInfo per entry and
    was a tenth of the time to inspect a 963-tensor rank file."""
    bounds = _directory_bounds(mm, base, length)
    if bounds is None:
        return None
    cd_start, cd_end, n_total = bounds
    out = []
    pos, unpack, new = cd_start, _CDIR.unpack_from, tuple.__new__
    for _ in range(n_total):
        if pos + 46 > cd_end:
            return None
        sig, flags, method, crc, csize, usize, nlen, elen, clen, hoff = unpack(mm, pos)
        if sig != b"PK\x01\x02" or 0xFFFFFFFF in (csize, usize, hoff):
            return None
        name = mm[pos + 46:pos + 46 + nlen].decode("utf-8" if flags & 0x800 else "cp437")
        out.append(new(_Entry, (name, method, crc, usize, csize, hoff)))
        pos += 46 + nlen + elen + clen
    return out if pos == cd_end else None


def _directory_bounds(mm, base: int, length: int) -> tuple[int, int, int] | None:
    """(start, end, entry count) of the central directory of the zip archive in
    ``mm[base:base+length]`` (absolute offsets), or None for anything but the plain layout
    torch writes (see :func:`_fast_directory`)."""
    end = base + length
    if length < _EOCD.size:
        return None
    sig, disk, cd_disk, n_here, n_total, cd_size, cd_off, comment = _EOCD.unpack_from(
        mm, end - _EOCD.size)
    if sig != b"PK\x05\x06" or comment or disk or cd_disk or n_here != n_total:
        return None
    eocd_at = end - _EOCD.size
    if 0xFFFF in (n_here, n_total) or 0xFFFFFFFF in (cd_size, cd_off):
        at = eocd_at - _Z64_LOCATOR.size
        if at < base:
            return None
        lsig, _, z64_at, _ = _Z64_LOCATOR.unpack_from(mm, at)
        if lsig != b"PK\x06\x07" or base + z64_at + _Z64_EOCD.size > at:
            return None
        (zsig, _, _, _, zdisk, zcd_disk, n_here, n_total, cd_size,
         cd_off) = _Z64_EOCD.unpack_from(mm, base + z64_at)
        if zsig != b"PK\x06\x06" or zdisk or zcd_disk or n_here != n_total:
            return None
        cd_end = base + z64_at
    else:
        cd_end = eocd_at
        if cd_end - _Z64_LOCATOR.size >= base and bytes(
                mm[cd_end - _Z64_LOCATOR.size:cd_end - _Z64_LOCATOR.size + 4]) == b"PK\x06\x07":
            cd_end -= _Z64_LOCATOR.size + _Z64_EOCD.size  # zip64 records not needed here
    if base + cd_off + cd_size != cd_end:
        return None  # bytes before the archive (zipfile's "concat"): leave it to zipfile
    if cd_end > len(mm):
        return None
    return base + cd_off, cd_end, n_total


class _ArrayDirectory:
    """A zip central directory held as numpy arrays (one entry per row): the mapping
    ``name -> _Entry`` that :func:`_read_archive` reads (entries built on demand), plus
    :meth:`locate` for many storages at once. For rank files of many ranks x many tensors,
    where a Python step per entry was a third of reading a recognised file.

    Names are kept without ``prefix``, the folder every entry of a ``torch.save`` archive
    is under (the file's stem when it was saved, e.g. ``model_world_size_8_rank_3/``; ""
    when the entries share none), so rank files of one run share one index."""

    def __init__(self, prefix: str, tails: list[str], fields, index=None):
        self.prefix = prefix
        self.tails = tails
        self.index = {n: i for i, n in enumerate(tails)} if index is None else index
        self.flags, self.method, self.crc, self.csize, self.usize, self.hoff = fields
        #: what was found once per layout, for other files of it: :meth:`locate`'s arrays
        #: per list of storages, and the tails of the pickles' names (key "pickles")
        self.located: dict = {}

    @property
    def names(self) -> list[str]:
        return [self.prefix + t for t in self.tails]

    def like(self, prefix: str, crc, hoff) -> "_ArrayDirectory":
        """This directory as another rank file of the same layout has it: its own folder
        ``prefix``, CRC-32 values and local header offsets; the other fields, the index
        and what :meth:`locate` learnt are shared."""
        d = _ArrayDirectory(prefix, self.tails, (self.flags, self.method, crc, self.csize,
                                                 self.usize, hoff), self.index)
        d.located = self.located
        return d

    def _find(self, name: str):
        if not name.startswith(self.prefix):
            return None
        return self.index.get(name[len(self.prefix):])

    def __iter__(self):
        return iter(self.names)

    def get(self, name, default=None):
        i = self._find(name)
        if i is None:
            return default
        return _Entry((name, int(self.method[i]), int(self.crc[i]), int(self.usize[i]),
                       int(self.csize[i]), int(self.hoff[i])))

    def __getitem__(self, name):
        got = self.get(name)
        if got is None:
            raise KeyError(name)
        return got

    def locate(self, mm, base: int, size: int, prefix: str, needs, path: str
               ) -> dict[str, int]:
        """:func:`_locate` with numpy: the same checks and messages, all entries at once."""
        import numpy as np

        # rank files of one layout name the same storages: the lookups and the checks that
        # depend on the directory alone are made once (per storage list and pickle folder)
        key = (id(needs), prefix[len(self.prefix):] if prefix.startswith(self.prefix)
               else "\0" + prefix)
        known = self.located.get(key)
        if known is None or known[0] is not needs:
            known = (needs, *self._prepare(prefix, needs))
            self.located[key] = known
        _, keys, idx, held, error, short = known
        if error is not None:
            raise BadCheckpointError(error, path)

        def first(bad) -> str:
            return keys[int(np.argmax(bad))]

        at = self.hoff[idx] + base
        bad = at + 30 > size
        if bad.any():
            raise BadCheckpointError(f"storage {first(bad)}: bad zip local header", path)
        raw = np.frombuffer(mm, dtype=np.uint8)
        # of each local header: the signature (bytes 0-3) and the name and extra field
        # lengths (26-29); a copy: the mapping is free to close
        heads = raw[at[:, None] + _HEAD_BYTES]
        del raw
        bad = (heads[:, :4] != _LOCAL_SIGNATURE).any(axis=1)
        if bad.any():
            raise BadCheckpointError(f"storage {first(bad)}: bad zip local header", path)
        lens = heads[:, 4:].astype(np.int64)
        data = at + 30 + lens[:, 0] + (lens[:, 1] << 8) + lens[:, 2] + (lens[:, 3] << 8)
        if short is not None:
            raise BadCheckpointError(short, path)
        bad = data + held > size
        if bad.any():
            i = int(np.argmax(bad))
            raise BadCheckpointError(f"storage {keys[i]} ends at byte {int(data[i] + held[i])} "
                                     f"but the file has {size}: truncated", path)
        return dict(zip(keys, data.tolist()))

    def _prepare(self, prefix: str, needs):
        """What :meth:`locate` checks of ``needs`` in the directory alone: ``(keys, entry
        rows, bytes held, the message of a missing or compressed entry or None, the message
        of a short one or None)`` (in the order of :func:`_locate`'s checks: a short entry is
        reported after its local header's)."""
        import numpy as np

        keys = [k for k, _ in needs]
        idx = []
        for key in keys:
            i = self._find(f"{prefix}data/{key}")
            if i is None:
                return keys, None, None, f"storage {key} is missing from the archive", None
            idx.append(i)
        idx = np.asarray(idx, dtype=np.int64)
        bad = self.method[idx] != zipfile.ZIP_STORED
        if bad.any():
            return keys, None, None, f"storage {keys[int(np.argmax(bad))]} is compressed", None
        held = self.usize[idx]
        need = np.asarray([n for _, n in needs], dtype=np.int64)
        bad = held < need
        short = None
        if bad.any():
            i = int(np.argmax(bad))
            short = f"storage {keys[i]} holds {int(held[i])} bytes, {int(need[i])} expected"
        return keys, idx, held, None, short


_CD_SIGNATURE = None
#: of a zip local header: the signature and the name and extra field lengths; of a central
#: directory entry: the CRC-32, the name length and the local header offset, which differ
#: between rank files of one layout (APPNOTE.TXT 4.3.7, 4.3.12)
_HEAD_BYTES = _LOCAL_SIGNATURE = _VARYING = None


class DirectoryCache:
    """The central directories of the rank files read so far, to recognise the next file's.
    Rank files of one run (one layout of storages) have the same directory but for their
    folder name (``model_world_size_8_rank_3/``, before every entry name), and hence the
    name lengths and local header offsets, and the CRC-32 values: a directory that equals
    a known one byte for byte once the known one's folder is replaced by this file's and
    those three fields are set aside is that one (the fields then read with numpy), so
    names, sizes and offsets are not parsed again. A few layouts are kept (the even-chunk
    rule of FSDP gives the last ranks other local shapes: other storage sizes)."""

    LIMIT = 4

    def __init__(self):
        #: (directory bytes cut at each name's folder with the varying fields zeroed, the
        #: folder's bytes, entry starts, name lengths, text encoding, directory)
        self.items: list[tuple] = []

    def match(self, cd: bytes) -> "_ArrayDirectory | None":
        import numpy as np

        for i, item in enumerate(self.items):
            masked, folder, starts, nlen, enc, known, shifted = item
            n = len(starts)
            # this file's folder: its first name less the known first name's tail
            tail = known.tails[0].encode(enc)
            first_len = int.from_bytes(cd[28:30], "little") if len(cd) >= 46 else -1
            name0 = cd[46:46 + first_len] if first_len >= len(tail) else b""
            if not name0.endswith(tail) or cd[:4] != b"PK\x01\x02":
                continue
            mine_folder = name0[:len(name0) - len(tail)]
            if (mine_folder[-1:] != b"/") if folder else mine_folder:
                continue
            grow = len(mine_folder) - len(folder)
            if len(cd) != len(masked) + n * grow:
                continue
            at = shifted.get(grow)
            if at is None:  # where the fields and folders lie in a directory of this width
                # (the known directory's bytes outside the folders, fields zeroed, with
                # zeroed folders of this width between them)
                at = starts + np.arange(n, dtype=np.int64) * grow
                folders = (at[:, None] + 46 + _arange(len(mine_folder))).ravel()
                want = bytearray(len(cd))
                keep = np.ones(len(cd), dtype=bool)
                keep[folders] = False
                np.frombuffer(want, dtype=np.uint8)[keep] = \
                    np.frombuffer(masked, dtype=np.uint8)[_kept(masked, starts, folder)]
                zero = np.concatenate([(at[:, None] + _VARYING).ravel(), folders])
                at = shifted[grow] = (at, folders, zero, bytes(want))
            at, folders, zero, want = at
            mine = bytearray(cd)
            a = np.frombuffer(mine, dtype=np.uint8)
            if a[folders].tobytes() != mine_folder * n:  # every name under this folder
                continue
            b = a[at[:, None] + _VARYING].astype(np.int64)
            a[zero] = 0
            if mine != want:
                continue
            if ((b[:, 4] | (b[:, 5] << 8)) != nlen + grow).any():
                continue
            crc = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
            hoff = b[:, 6] | (b[:, 7] << 8) | (b[:, 8] << 16) | (b[:, 9] << 24)
            if (hoff == 0xFFFFFFFF).any():
                continue  # zip64: parse it
            if i:
                self.items.insert(0, self.items.pop(i))
            return known.like(mine_folder.decode(enc), crc, hoff)
        return None

    def learn(self, cd: bytes, starts, nlen, known: "_ArrayDirectory", enc: str) -> None:
        import numpy as np

        masked = bytearray(cd)
        np.frombuffer(masked, dtype=np.uint8)[(starts[:, None] + _VARYING).ravel()] = 0
        folder = known.prefix.encode(enc)
        self.items.insert(0, (bytes(masked), folder, starts, nlen, enc, known, {}))
        del self.items[self.LIMIT:]


def _arange(n: int):
    import numpy as np

    return np.arange(n, dtype=np.int64)


def _kept(masked: bytes, starts, folder: bytes):
    """The positions of ``masked`` (a known directory) outside its entries' folders, in
    order: the bytes a directory of another folder width has at its own kept positions."""
    import numpy as np

    keep = np.ones(len(masked), dtype=bool)
    keep[(starts[:, None] + 46 + _arange(len(folder))).ravel()] = False
    return keep


def _array_directory(mm, base: int, length: int, cache: DirectoryCache | None = None
                     ) -> _ArrayDirectory | None:
    """The central directory as :class:`_ArrayDirectory`: the entry signatures found with
    one regular-expression scan, their fields gathered with numpy, and accepted only when
    the entries chain exactly from the directory's start to its end (each entry's lengths
    lead to the next signature found), so the result is the one-by-one parse's; None
    otherwise (the caller then parses entry by entry). ``cache``: the directories of the
    rank files read before (:class:`DirectoryCache`), consulted first and taught this one."""
    import re

    import numpy as np

    global _CD_SIGNATURE, _HEAD_BYTES, _LOCAL_SIGNATURE, _VARYING
    if _CD_SIGNATURE is None:
        _HEAD_BYTES = np.asarray([0, 1, 2, 3, 26, 27, 28, 29], dtype=np.int64)
        _LOCAL_SIGNATURE = np.frombuffer(b"PK\x03\x04", dtype=np.uint8)
        _VARYING = np.asarray([16, 17, 18, 19, 28, 29, 42, 43, 44, 45], dtype=np.int64)
        _CD_SIGNATURE = re.compile(re.escape(b"PK\x01\x02"))
    bounds = _directory_bounds(mm, base, length)
    if bounds is None:
        return None
    cd_start, cd_end, n_total = bounds
    cd = mm[cd_start:cd_end]
    if cache is not None and n_total:
        known = cache.match(cd)
        if known is not None:
            return known
    pos = [m.start() for m in _CD_SIGNATURE.finditer(cd)]
    if len(pos) != n_total or not pos or pos[0] != 0:
        return None
    a = np.frombuffer(cd, dtype=np.uint8).astype(np.int64)
    p = np.asarray(pos, dtype=np.int64)
    if int(p[-1]) + 46 > len(cd):
        return None

    def u16(off):
        return a[p + off] | (a[p + off + 1] << 8)

    def u32(off):
        return u16(off) | (u16(off + 2) << 16)

    nlen, elen, clen = u16(28), u16(30), u16(32)
    nxt = p + 46 + nlen + elen + clen
    if (nxt[:-1] != p[1:]).any() or int(nxt[-1]) != len(cd):
        return None
    flags, method, crc, csize, usize, hoff = u16(8), u16(10), u32(16), u32(20), u32(24), u32(42)
    if (csize == 0xFFFFFFFF).any() or (usize == 0xFFFFFFFF).any() or (hoff == 0xFFFFFFFF).any():
        return None
    utf8 = (flags & 0x800).tolist()
    names = [cd[q + 46:q + 46 + n].decode("utf-8" if u else "cp437")
             for q, n, u in zip(pos, nlen.tolist(), utf8)]
    # the folder all entries share (torch.save's archive name), when they share one
    folder = names[0][:names[0].find("/") + 1]
    if not folder or not all(n.startswith(folder) for n in names):
        folder = ""
    out = _ArrayDirectory(folder, [n[len(folder):] for n in names],
                          (flags, method, crc, csize, usize, hoff))
    one_encoding = len(set(utf8)) == 1
    if cache is not None and one_encoding:
        cache.learn(cd, p, nlen, out, "utf-8" if utf8[0] else "cp437")
    return out


def _locate(mm, base: int, size: int, infos: dict, prefix: str, needs, path: str
            ) -> dict[str, int]:
    """Absolute data offset of each storage in ``needs`` (``(key, bytes needed)`` pairs), with
    the checks of the unpickling path: entry present and stored uncompressed, a local header
    signature, at least the bytes needed, and all of them inside the file."""
    out = {}
    get = infos.get
    for key, need in needs:
        info = get(f"{prefix}data/{key}")
        if info is None:
            raise BadCheckpointError(f"storage {key} is missing from the archive", path)
        if info[1] != zipfile.ZIP_STORED:
            raise BadCheckpointError(f"storage {key} is compressed", path)
        at = _local_data_offset(mm, base, size, info, f"storage {key}", path)
        held = info[3]
        if held < need:
            raise BadCheckpointError(f"storage {key} holds {held} bytes, {need} expected", path)
        if at + held > size:
            raise BadCheckpointError(f"storage {key} ends at byte {at + held} but the file has "
                                     f"{size}: truncated", path)
        out[key] = at
    return out


def _local_data_offset(mm, base: int, size: int, e: _Entry, what: str, path: str) -> int:
    """Absolute offset of entry ``e``'s data, from its local header (whose name and extra
    field lengths may differ from the central directory's)."""
    at = base + e.header_offset
    if at + 30 > size or bytes(mm[at:at + 4]) != b"PK\x03\x04":
        raise BadCheckpointError(f"{what}: bad zip local header", path)
    n, m = struct.unpack_from("<HH", mm, at + 26)
    return at + 30 + n + m


def _read_archive(path: str, base: int, length: int | None, reuse=None,
                  directories: DirectoryCache | None = None) -> TorchArchive:
    import mmap
    import zlib

    from ..dtypes import ITEMSIZE

    try:
        f = open(path, "rb")
    except OSError as e:
        raise BadCheckpointError(f"cannot open: {e.strerror}", path) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if length is None:
            length = size - base
        if base + length > size:
            raise BadCheckpointError(f"file is {size} bytes, the checkpoint needs "
                                     f"{base + length}: truncated", path)
        if size == 0:
            raise BadCheckpointError("empty file (0 bytes)", path)
        f.seek(base)
        magic = f.read(4)
        if magic != b"PK\x03\x04" and not (base == 0 and magic[:1] == b"\x80"):
            # a zip archive starts with a local file header (APPNOTE.TXT 4.3.7); a legacy
            # torch.save file with a pickle protocol opcode (0x80)
            raise BadCheckpointError("not a zip archive (torch.save) file: it does not start "
                                     "with a zip header", path)
        # one mapping for the directory, the pickle and all local headers: a read() per
        # storage costs more on big files
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        try:
            # many rank files of one run (``reuse``): the directory as arrays
            infos = (_array_directory(mm, base, length, directories)
                     if size and reuse is not None else None)
            entries = _fast_directory(mm, base, length) if size and infos is None else None
            if entries is None and infos is None:
                try:
                    zf = zipfile.ZipFile(_Window(f, base, length))
                    entries = [_Entry((i.filename, i.compress_type, i.CRC, i.file_size,
                                       i.compress_size, i.header_offset))
                               for i in zf.infolist()]
                except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
                    if base == 0 and _is_legacy_pickle(f):
                        return _read_legacy(f, path, size)
                    raise BadCheckpointError(f"not a torch.save archive ({e}); truncated or "
                                             "corrupt?", path) from None
            if infos is None:
                infos = {e.filename: e for e in entries}
            if isinstance(infos, _ArrayDirectory):  # the pickle's name: once per layout
                tails = infos.located.get("pickles")
                if tails is None:
                    tails = infos.located["pickles"] = [
                        t for t, n in zip(infos.tails, infos.names)
                        if n.endswith("/data.pkl") or n == "data.pkl"]
                pkl = [infos.prefix + t for t in tails]
            else:
                pkl = [n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise BadCheckpointError("torch.save archive without a single data.pkl", path)
            prefix = pkl[0][: -len("data.pkl")]

            def stored(e: _Entry) -> bytes:
                if e.compress_type != zipfile.ZIP_STORED or e.compress_size != e.file_size:
                    raise BadCheckpointError(f"{e.filename} is compressed", path)
                at = _local_data_offset(mm, base, size, e, e.filename, path)
                if at + e.file_size > size:
                    raise BadCheckpointError(f"{e.filename} ends at byte {at + e.file_size} "
                                             f"but the file has {size}: truncated", path)
                data = mm[at:at + e.file_size]
                if zlib.crc32(data) != e.CRC:
                    raise BadCheckpointError(f"corrupt torch.save archive (bad CRC-32 of "
                                             f"{e.filename})", path)
                return data

            byteorder = infos.get(prefix + "byteorder")
            if byteorder is not None and stored(byteorder).strip() not in (b"little", b""):
                raise BadCheckpointError("big-endian archives are not supported", path)
            storages: dict[str, StorageRef] = {}
            data = stored(infos[pkl[0]])
            reused = reuse(data) if reuse is not None else None
            if reused is not None:
                root, needs = reused
                if isinstance(infos, _ArrayDirectory):
                    offsets = infos.locate(mm, base, size, prefix, needs, path)
                else:
                    offsets = _locate(mm, base, size, infos, prefix, needs, path)
                return TorchArchive(path, root, {}, offsets)
            try:
                root = RestrictedUnpickler(io.BytesIO(data), path, storages).load()
            except (UnsafeCheckpointError, BadCheckpointError) as e:
                if e.path is None:
                    e.path = path
                raise
            except Exception as e:  # noqa: BLE001 - any failure on untrusted bytes
                raise BadCheckpointError(f"corrupt pickle in torch.save archive "
                                         f"({type(e).__name__}: {e})", path) from None
            for key, ref in storages.items():
                if ref.dtype not in ITEMSIZE or not isinstance(ref.numel, int) or ref.numel < 0:
                    raise BadCheckpointError(f"storage {key}: corrupt record", path)
                info = infos.get(f"{prefix}data/{key}")
                if info is None:
                    raise BadCheckpointError(f"storage {key} is missing from the archive", path)
                if info.compress_type != zipfile.ZIP_STORED:
                    raise BadCheckpointError(f"storage {key} is compressed", path)
                ref.data_offset = _local_data_offset(mm, base, size, info, f"storage {key}",
                                                     path)
                ref.data_bytes = info.file_size
                need = ref.numel * ITEMSIZE[ref.dtype]
                if ref.data_bytes < need:
                    raise BadCheckpointError(f"storage {key} holds {ref.data_bytes} bytes, "
                                             f"{need} expected", path)
                if ref.data_offset + ref.data_bytes > size:
                    raise BadCheckpointError(f"storage {key} ends at byte "
                                             f"{ref.data_offset + ref.data_bytes} but the file has "
                                             f"{size}: truncated", path)
        finally:
            if size:
                mm.close()
        return TorchArchive(path, root, storages)


def _is_legacy_pickle(f) -> bool:
    f.seek(0)
    head = f.read(2)
    return len(head) == 2 and head[0] == 0x80  # a bare pickle protocol header


#: the legacy (non-zip) torch.save header: magic number and protocol version
#: (torch/serialization.py: MAGIC_NUMBER, PROTOCOL_VERSION)
LEGACY_MAGIC, LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001


def _read_legacy(f, path: str, size: int) -> TorchArchive:
    """Read a legacy (non-zip, ``_use_new_zipfile_serialization=False``) ``torch.save`` file.

    Format facts (torch/serialization.py ``_legacy_save``; checked on files written by torch
    2.13): five pickles and raw data in a row: the magic number, the protocol version, a
    ``sys_info`` dict (``little_endian``), the object (persistent ids ``('storage', cls, key,
    location, numel, None)``), the sorted list of storage keys; then for each key in that
    order an 8-byte little-endian element count followed by the storage's bytes."""
    from ..dtypes import ITEMSIZE

    try:
        f.seek(0)
        magic = RestrictedUnpickler(f, path, {}).load()
        proto = RestrictedUnpickler(f, path, {}).load()
        info = RestrictedUnpickler(f, path, {}).load()
        if magic != LEGACY_MAGIC or proto != LEGACY_PROTOCOL or not isinstance(info, dict):
            raise BadCheckpointError("not a torch.save file (a pickle without torch's magic "
                                     "number)", path)
        if not info.get("little_endian", True):
            raise BadCheckpointError("big-endian archives are not supported", path)
        storages: dict[str, StorageRef] = {}
        root = RestrictedUnpickler(f, path, storages).load()
        keys = RestrictedUnpickler(f, path, {}).load()
    except (UnsafeCheckpointError, BadCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - any failure on untrusted bytes means corrupt
        raise BadCheckpointError(f"corrupt pickle in legacy torch.save file "
                                 f"({type(e).__name__}: {e}); truncated or corrupt?",
                                 path) from None
    if not isinstance(keys, list) or set(map(str, keys)) != set(map(str, storages)):
        raise BadCheckpointError("legacy torch.save file: its storage list does not match "
                                 "the storages its object names", path)
    pos = f.tell()
    for key in keys:
        ref = storages[key]
        if ref.dtype not in ITEMSIZE or not isinstance(ref.numel, int) or ref.numel < 0:
            raise BadCheckpointError(f"storage {key}: corrupt record", path)
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            raise BadCheckpointError(f"storage {key} starts at byte {pos} but the file has "
                                     f"{size}: truncated", path)
        (numel,) = struct.unpack("<q", head)
        if numel != ref.numel:
            raise BadCheckpointError(f"storage {key} holds {numel} elements, {ref.numel} "
                                     "expected", path)
        ref.data_offset, ref.data_bytes = pos + 8, numel * ITEMSIZE[ref.dtype]
        pos = ref.data_offset + ref.data_bytes
        if pos > size:
            raise BadCheckpointError(f"storage {key} ends at byte {pos} but the file has "
                                     f"{size}: truncated", path)
    return TorchArchive(path, root, storages)
