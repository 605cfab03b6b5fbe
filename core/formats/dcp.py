"""PyTorch Distributed Checkpoint (DCP) folders: ``.metadata`` + ``__{rank}_{i}.distcp``.

Format facts (torch/distributed/checkpoint/{metadata,filesystem}.py; checked on folders written
by ``torch.distributed.checkpoint.save`` under torch 2.13): ``.metadata`` is a pickle of
``Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)``;
``state_dict_metadata`` maps each flattened key to ``TensorStorageMetadata(properties, size,
chunks=[ChunkStorageMetadata(offsets, sizes)])`` or ``BytesStorageMetadata``; ``storage_data``
maps ``MetadataIndex(fqn, offset, index)`` to ``_StorageInfo(relative_path, offset, length,
transform_descriptors)``; each tensor chunk is a complete ``torch.save`` archive embedded at
that byte range of the ``.distcp`` file. ``planner_data`` maps each key to its nesting path.
``TensorProperties`` pickles ``(dtype, layout, requires_grad, memory_format, pin_memory)``;
torch 2.15 appends the tensor's ``strides`` (torch/distributed/checkpoint/metadata.py): the dtype
stays first.

Why not ``FileSystemReader.read_metadata``: it unpickles ``.metadata`` without restriction
(untrusted input) and needs a torch import; the restricted reader gives the same records.
Accelerate nests the model under ``model`` (``pytorch_model_fsdp_0/``); torchtitan keeps flat
model keys beside ``train_state``, ``optimizer`` ..., which are not model weights.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..dtypes import ITEMSIZE
from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo, coverage_problems
from .common import attach_config, clean_key, contained, corrupt_is_bad, stat_file
from .torchsave import DType, Record, RestrictedUnpickler, read_torch_archive

#: top-level entries of a training checkpoint that are not model weights
NON_MODEL_KEYS = ("optimizer", "optim", "train_state", "lr_scheduler", "lr_schedulers",
                  "dataloader", "rng", "rng_state", "extra_state", "scheduler")

#: folder names accelerate gives a DCP model checkpoint
ACCELERATE_DIRS = ("pytorch_model_fsdp_0", "model")


def find_dcp_dir(path: str) -> Path | None:
    """The folder holding ``.metadata``: ``path`` itself or accelerate's subfolder."""
    p = Path(path)
    try:
        if (p / ".metadata").is_file():
            return p
        for name in ACCELERATE_DIRS:
            if (p / name / ".metadata").is_file():
                return p / name
    except OSError:
        return None
    return None


def sniff(path: str) -> bool:
    """True when ``path`` (or accelerate's ``pytorch_model_fsdp_0/`` in it) is a DCP folder."""
    return find_dcp_dir(path) is not None


def load_metadata(meta_path: Path) -> Record:
    """The ``Metadata`` record of a ``.metadata`` file. Raises BadCheckpointError."""
    try:
        with open(meta_path, "rb") as f:
            m = RestrictedUnpickler(f, str(meta_path), {}).load()
    except BadCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise BadCheckpointError(f"corrupt DCP metadata ({type(e).__name__}: {e})",
                                 str(meta_path)) from None
    if not isinstance(m, Record) or m.name != "Metadata":
        raise BadCheckpointError("not a DCP Metadata pickle", str(meta_path))
    return m


def model_keys(keys: list[str], planner_data: dict) -> dict[str, str]:
    """Map checkpoint keys to model tensor names. When the state is nested under ``model``
    (accelerate), keep those keys and drop the prefix; otherwise drop the known non-model
    entries (``train_state``, ``optimizer``, ...)."""
    # planner_data keeps the dict nesting: a flat key "model.embed_tokens.weight" has the
    # one-element path ("model.embed_tokens.weight",); accelerate's nested one ("model", ...).
    paths = {k: tuple(planner_data.get(k) or (k,)) for k in keys}
    out = {}
    if any(len(p) > 1 and p[0] == "model" for p in paths.values()):
        for k, p in paths.items():
            if len(p) > 1 and p[0] == "model":
                out[k] = clean_key(".".join(map(str, p[1:])))
        return out
    for k, p in paths.items():
        if str(p[0]) in NON_MODEL_KEYS or k.split(".", 1)[0] in NON_MODEL_KEYS:
            continue
        out[k] = clean_key(k)
    return out


def _metadata_file(path: str) -> Path:
    return (find_dcp_dir(path) or Path(path)) / ".metadata"


@corrupt_is_bad("DCP metadata", where=_metadata_file)
def read(path: str) -> CheckpointLayout:
    """Read a DCP folder's layout from ``.metadata`` alone (the chunks' byte locations inside
    the ``.distcp`` files are located later, by the layout's ``resolve_piece``). Unexpected
    content of the ``.metadata`` records becomes :class:`BadCheckpointError` naming that file.

    Problems: a ``.distcp`` that is missing (``missing-file``) or shorter than a chunk it holds
    (``truncated-file``); chunks that do not tile a tensor. Raises BadCheckpointError when
    ``.metadata`` is unreadable.
    """
    d = find_dcp_dir(path)
    if d is None:
        raise BadCheckpointError("no .metadata file: not a DCP folder", path)
    meta_path = d / ".metadata"
    m = load_metadata(meta_path)
    sdm = m.get("state_dict_metadata") or {}
    storage = m.get("storage_data") or {}
    planner = m.get("planner_data") or {}
    layout = CheckpointLayout(format="dcp", path=str(path), world_size=0)
    layout.resolve_piece = make_resolver()
    tensor_keys = [k for k, v in sdm.items() if isinstance(v, Record)
                   and v.name == "TensorStorageMetadata"]
    names = model_keys(tensor_keys, planner)
    skipped = len(sdm) - len(names)
    # (fqn, offsets) -> storage info
    where: dict[tuple[str, tuple], Record] = {}
    for idx, info in storage.items():
        if isinstance(idx, Record):
            where[(idx.get("fqn"), tuple(idx.get("offset") or ()))] = info
    files: dict[str, int] = {}
    inside: dict[str, str] = {}
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    sizes: dict[str, int | None] = {}
    try:
        for name in sorted(os.listdir(d)):
            if name.endswith(".distcp"):
                sizes[name] = os.stat(d / name).st_size
    except OSError as e:
        raise BadCheckpointError(f"cannot list the folder: {e.strerror}", str(d)) from None
    for key, name in names.items():
        tm = sdm[key]
        props = tm.get("properties")
        dtype = "F32"
        if isinstance(props, Record):
            st = props.state
            dt = st[0] if isinstance(st, tuple) else props.get("dtype")
            dtype = dt.name if isinstance(dt, DType) else dtype
        if dtype not in ITEMSIZE:  # e.g. torch.complex128: no safetensors name
            layout.problems.append(Problem(
                "unsupported-dtype", f"{name}: torch.{dtype.split(':')[-1]}, a dtype "
                "safetensors cannot hold (unsupported)", str(meta_path)))
            continue
        t = TensorInfo(name, tuple(tm.get("size")), dtype,
                       "DCP chunks" if len(tm.get("chunks") or ()) > 1 else "DCP")
        for ch in tm.get("chunks") or ():
            offsets, csize = tuple(ch.get("offsets")), tuple(ch.get("sizes"))
            if not (len(offsets) == len(csize) == len(t.shape)) or any(
                    not isinstance(x, int) or x < 0 for x in (*offsets, *csize)):
                layout.problems.append(Problem("bad-chunk", f"{name}: a chunk of a "
                                               f"{len(t.shape)}-d tensor at {offsets} with "
                                               f"sizes {csize}", str(meta_path)))
                continue
            info = where.get((key, offsets))
            if info is None:
                layout.problems.append(Problem("missing-chunk", f"{name}: no storage entry for "
                                               f"the chunk at {offsets}", str(meta_path)))
                continue
            rel = info.get("relative_path")
            if not isinstance(rel, str):
                raise BadCheckpointError(f"{name}: storage entry without a relative_path",
                                         str(meta_path))
            fpath = inside.get(rel)
            if fpath is None:  # once per file: a big checkpoint has thousands of chunks
                fpath = inside[rel] = str(contained(d, rel, f"the storage entry of {name}",
                                                    meta_path))
            rank = _rank_of(rel)
            start, length = int(info.get("offset")), int(info.get("length"))
            files[rel] = max(files.get(rel, 0), start + length)
            if info.get("transform_descriptors"):
                layout.problems.append(Problem(
                    "unsupported-transform", f"{name}: chunk stored with transforms "
                    f"{info.get('transform_descriptors')}", fpath))
            # an embedded torch.save archive at [start, start+length), located later
            t.pieces.append(Piece(fpath, 0, dtype, csize, c_strides(csize), offsets, rank,
                                  archive=(start, length, csize)))
            ranges.setdefault(rel, []).append((start, length, name))
        layout.tensors[name] = t
    for rel, spans in sorted(ranges.items()):  # each chunk owns its bytes
        spans.sort()
        for (a, n, x), (b, _, y) in zip(spans, spans[1:]):
            if b < a + n:
                layout.problems.append(Problem(
                    "overlapping-chunks", f"{rel}: the bytes of {x} and {y} overlap "
                    f"(at {b}): corrupt .metadata", str(meta_path)))
                break
    for rel, need in sorted(files.items()):
        fpath = str(d / rel)
        sf = stat_file(fpath, _rank_of(rel))
        layout.files.append(sf)
        if sf.status == "missing":
            layout.problems.append(Problem("missing-file", f".metadata names {rel}, which is "
                                           "missing", fpath))
        elif sf.bytes != need:  # only then read a few header bytes: inspect stays cheap
            wrong = _misplaced(fpath, ranges.get(rel, ()))
            if wrong is not None or sf.bytes < need:
                sf.status = "unreadable"
                layout.problems.append(_size_problem(rel, fpath, sf.bytes, need, wrong, files))
    # every file a storage entry names belongs to the checkpoint, also those holding only
    # skipped items (optimizer, train_state) as a one-file-per-item writer leaves them
    named = {info.get("relative_path") for info in storage.values() if isinstance(info, Record)}
    for rel in sizes:
        if rel not in files and rel not in named:
            layout.problems.append(Problem("extra-file", f"{rel} is not named by .metadata",
                                           str(d / rel), "warning"))
    ranks = {f.rank for f in layout.files if f.rank is not None}
    layout.world_size = max(ranks) + 1 if ranks else 1
    layout.parallel = {"fsdp": layout.world_size} if layout.world_size > 1 else {}
    if skipped:
        layout.notes.append(f"{skipped} non-model or non-tensor entries skipped")
    if not layout.errors:
        for t in layout.tensors.values():
            layout.problems.extend(coverage_problems(t))
    cfg = _config_dir(Path(path), d)
    attach_config(layout, cfg)
    return layout


#: the first bytes of a zip local file header: every chunk ``FileSystemWriter`` writes is a
#: ``torch.save`` zip archive starting at its storage entry's ``offset``
#: (torch/distributed/checkpoint/filesystem.py ``_write_item``; zip: PKWARE APPNOTE 4.3.7)
ZIP_LOCAL = b"PK\x03\x04"


def _misplaced(fpath: str, spans) -> tuple[int, int, str, int] | None:
    """For a ``.distcp`` file whose size is not the one ``.metadata`` implies: (chunks that do
    not start with a zip header where .metadata places them, chunks looked at, the first
    such tensor, its byte) — or None when every chunk inside the file starts where it should
    (then a short file is truncated). ``spans``: (start, length, tensor) per chunk."""
    bad, seen, first = 0, 0, None
    try:
        with open(fpath, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for start, _, name in spans:
                if start + len(ZIP_LOCAL) > size:
                    continue  # beyond the end: truncation, said by the sizes
                f.seek(start)
                seen += 1
                if f.read(len(ZIP_LOCAL)) != ZIP_LOCAL:
                    bad += 1
                    first = first or (name, start)
    except OSError:
        return None
    return (bad, seen, *first) if bad else None


def _size_problem(rel: str, fpath: str, size: int, need: int, wrong, files: dict) -> Problem:
    """``truncated-file`` when the file is short and every chunk it still holds is in place;
    ``file-mismatch`` when the file does not hold the records .metadata places in it (another
    file under this name: swapped, renamed or overwritten), naming the file whose size it has."""
    if wrong is None:
        return Problem("truncated-file", f"{rel} is {size} bytes, .metadata needs {need}: "
                       "truncated", fpath)
    bad, seen, name, at = wrong
    other = sorted(r for r, n in files.items() if n == size and r != rel)
    hint = (f"; its size is the one .metadata gives {other[0]}: the files may be swapped or "
            "renamed" if other else "; another file under this name")
    return Problem("file-mismatch", f"{rel} does not hold the records .metadata places in "
                   f"it: {bad} of {seen} chunks are not where .metadata says (the first, of "
                   f"{name}, at byte {at}); it is {size} bytes, .metadata needs {need}{hint}",
                   fpath)


def _config_dir(path: Path, d: Path) -> Path | None:
    for c in (path / "huggingface", d / "huggingface", path):
        if (c / "config.json").is_file():
            return c
    return None


def _rank_of(rel: str) -> int | None:
    """``__{rank}_{i}.distcp`` -> rank (the writer's rank, per FileSystemWriter's naming)."""
    stem = rel.rsplit("/", 1)[-1]
    if stem.startswith("__"):
        try:
            return int(stem[2:].split("_", 1)[0])
        except ValueError:
            return None
    return None


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides (elements) of a C-contiguous tensor of ``shape``."""
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(out))


def make_resolver():
    """A ``resolve_piece`` function for one layout: it locates a piece's tensor bytes inside
    its embedded ``torch.save`` archive (each archive read once, then remembered) and returns
    the piece with its absolute ``byte_offset``. Raises BadCheckpointError when the chunk is
    unreadable, is not a tensor of the piece's dtype, is not C-contiguous, or is too small
    for the piece."""
    located: dict[tuple[str, int, int], tuple] = {}

    def locate(file: str, start: int, length: int) -> tuple:
        key = (file, start, length)
        if key not in located:
            ref = read_torch_archive(file, base=start, length=length).root
            if not hasattr(ref, "storage"):
                raise BadCheckpointError(f"chunk at byte {start} is not a tensor", file)
            if not ref.fits_storage():
                raise BadCheckpointError(f"chunk at byte {start}: view outside its storage",
                                         file)
            located[key] = (ref.byte_offset, tuple(ref.shape), tuple(ref.stride), ref.dtype)
        return located[key]

    def resolve_piece(p: Piece) -> Piece:
        if p.archive is None:
            return p
        start, length, chunk = p.archive
        offset, shape, stride, dtype = locate(p.file, start, length)
        if dtype != p.dtype or shape != tuple(chunk):
            raise BadCheckpointError(f"chunk at byte {start} holds {list(shape)} {dtype}, "
                                     f".metadata says {list(chunk)} {p.dtype}", p.file)
        if p.byte_offset == 0 and p.shape == shape and p.stride == c_strides(shape):
            # the whole chunk, any strides (a strided selection of it, e.g. rows permuted by
            # core/native_names.py, keeps its own strides below)
            return replace(p, byte_offset=offset, stride=stride, archive=None)
        numel = 1
        for s in shape:
            numel *= s
        end = (p.byte_offset // ITEMSIZE[p.dtype]
               + sum((s - 1) * st for s, st in zip(p.shape, p.stride)) + 1)
        if stride != c_strides(shape) or end > numel:
            raise BadCheckpointError(f"chunk at byte {start} holds {list(shape)}, which does "
                                     f"not contain the slice {list(p.shape)} the metadata "
                                     "implies", p.file)
        return replace(p, byte_offset=offset + p.byte_offset, archive=None)

    return resolve_piece
