"""Per-rank FSDP checkpoint files: verl's ``model_world_size_{W}_rank_{r}.pt`` layout and
accelerate's ``pytorch_model_fsdp_{i}_rank{r}.bin``.

Format facts (FORMATS.md; checked on files written by torch 2.13 with gloo): each file is a
``torch.save`` of one rank's ``model.state_dict()``. Values are DTensors under FSDP2 (their spec
records the device mesh, its dimension names, this rank's mesh coordinate, the placements and
the global shape), ShardedTensors under FSDP1 ``SHARDED_STATE_DICT`` (each records every rank's
``shard_offsets``/``shard_sizes``), or plain tensors (a world size of 1, or buffers, which are
saved full-size on every rank and must be taken once). ``fsdp_config.json`` holds
``{"FSDP_version", "world_size"}``; ``huggingface/`` the config and tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo, coverage_problems
from .common import attach_config, clean_key, problem_for, stat_file
from .torchsave import DType, Record, TensorRef, read_torch_archive

#: at most this many missing ranks are listed as files / as separate problems
MAX_LISTED = 1024
MAX_LISTED_PROBLEMS = 16

VERL_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
ACCELERATE_RE = re.compile(r"^pytorch_model_fsdp_(\d+)_rank(\d+)\.bin$")

#: the name FSDP1 gives a module's flat parameter (torch/distributed/fsdp/_flat_param.py
#: ``FLAT_PARAM``); ``LOCAL_STATE_DICT`` saves only these, one 1-D ShardedTensor per wrapped
#: module, without the shapes and offsets of the parameters flattened into it
FLAT_PARAM = "_flat_param"


def _rank_files(path: Path) -> tuple[str, dict[int, dict[int, str]]]:
    """The rank files in ``path``: (kind, {world size or model index: {rank: file}})."""
    verl: dict[int, dict[int, str]] = {}
    acc: dict[int, dict[int, str]] = {}
    try:
        names = os.listdir(path)
    except OSError:
        return "", {}
    for n in names:
        if m := VERL_RE.match(n):
            verl.setdefault(int(m[1]), {})[int(m[2])] = str(path / n)
        elif m := ACCELERATE_RE.match(n):
            acc.setdefault(int(m[1]), {})[int(m[2])] = str(path / n)
    if verl:
        return "verl", verl
    if acc:
        return "accelerate", acc
    return "", {}


def sniff(path: str) -> bool:
    """True when ``path`` is a folder holding per-rank FSDP model files."""
    p = Path(path)
    return p.is_dir() and bool(_rank_files(p)[1])


def _mesh_info(mesh: Record) -> tuple[tuple[int, ...], tuple[str, ...] | None, tuple[int, ...] | None]:
    """(mesh shape, dimension names, this rank's coordinate) from a pickled DeviceMesh.
    torch 2.13 keeps the shape in ``_layout.axes`` (one ``_FlatLayout`` per dim) and the
    coordinate in ``_coordinate_on_dim``; older releases keep a ``mesh`` tensor."""
    names = mesh.get("_mesh_dim_names")
    names = tuple(names) if names else None
    coord = mesh.get("_coordinate_on_dim")
    coord = tuple(coord) if coord is not None else None
    layout = mesh.get("_layout")
    shape: tuple[int, ...] = ()
    if isinstance(layout, Record) and layout.get("axes"):
        dims = []
        for ax in layout.get("axes"):
            s = ax.get("shape") if isinstance(ax, Record) else None
            dims.append(math.prod(_flatten(s)) if s is not None else 0)
        shape = tuple(dims)
    elif isinstance(mesh.get("mesh"), TensorRef):
        shape = mesh.get("mesh").shape
    elif isinstance(mesh.get("_rank_map"), TensorRef):
        shape = mesh.get("_rank_map").shape
    return shape, names, coord


def _flatten(x):
    if isinstance(x, (tuple, list)):
        for i in x:
            yield from _flatten(i)
    else:
        yield x


def _placement_str(p: Record) -> str:
    if p.name == "Shard" or p.name == "_StridedShard":
        return f"{p.name.lstrip('_')}({p.get('dim')})"
    return f"{p.name}()"


def local_box(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
              placements: list[Record]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) of the shard held at mesh coordinate ``coord``.

    DTensor's even-chunk rule (torch ``compute_local_shape_and_global_offset``, default shard
    order): mesh dims in order; ``Shard(d)`` over ``n`` ranks gives each ``ceil(size/n)``
    elements of dim ``d``, the last ones fewer or none. Raises ValueError for placements
    other than ``Shard``/``Replicate`` (``_StridedShard``, ``Partial``).
    """
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    for i, p in enumerate(placements):
        if p.name == "Replicate":
            continue
        if p.name != "Shard":
            raise ValueError(f"placement {_placement_str(p)} is not supported yet")
        d = p.get("dim")
        d = d + len(global_shape) if d < 0 else d
        n, c = mesh_shape[i], coord[i]
        chunk = -(-sizes[d] // n) if sizes[d] else 0
        start = min(chunk * c, sizes[d])
        offsets[d] += start
        sizes[d] = max(0, min(chunk, sizes[d] - start))
    return tuple(offsets), tuple(sizes)


def _state(rec: Record) -> dict:
    st = rec.state
    if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict):
        return st[1]
    return st if isinstance(st, dict) else {}


class _Builder:
    """Collects pieces of every tensor over the rank files."""

    def __init__(self, layout: CheckpointLayout):
        self.layout = layout
        self.keys_by_rank: dict[int, set[str]] = {}
        self.mesh: tuple[tuple[int, ...], tuple[str, ...] | None] | None = None
        self.shard_dims_by_mesh_dim: dict[int, set[str]] = {}
        self.skipped: set[str] = set()
        self.mesh_reported = False
        self.seen: set[tuple] = set()
        self.mesh_cache: dict[int, tuple] = {}
        self.flat_params: set[str] = set()
        #: what the last fully parsed rank file held, for :class:`_Template` (None: not
        #: reusable, e.g. ShardedTensors, whose offsets differ per rank inside the pickle)
        self.recording: list | None = None
        self.box_cache: dict[tuple, tuple] = {}
        #: cached ``_hash`` values the recorded DTensorSpecs and DeviceMesh pickle (they
        #: hash the coordinate, so they differ between rank files)
        self.hashes: set = set()

    def tensor(self, name: str, shape, dtype: str, placement: str, path: str) -> TensorInfo:
        t = self.layout.tensors.get(name)
        if t is None:
            t = self.layout.tensors[name] = TensorInfo(name, tuple(shape), dtype, placement)
        elif (t.shape, t.dtype, t.placement) != (tuple(shape), dtype, placement):
            self.layout.problems.append(Problem(
                "rank-disagreement", f"{name}: {tuple(shape)} {dtype} {placement} here, "
                f"{t.shape} {t.dtype} {t.placement} in an earlier rank file", path))
        return t

    def add(self, t: TensorInfo, piece: Piece) -> None:
        if piece.numel == 0:
            return
        key = (t.name, piece.global_offsets, piece.shape)
        if key in self.seen:  # replicas (HSDP, replicated buffers): keep the first copy
            return
        self.seen.add(key)
        t.pieces.append(piece)

    def add_rank(self, rank: int, path: str, root) -> None:
        if not isinstance(root, dict):
            raise BadCheckpointError("the pickle is not a state dict", path)
        keys = set()
        for key, value in root.items():
            name = clean_key(str(key))
            keys.add(name)
            if name.rsplit(".", 1)[-1] == FLAT_PARAM:
                self.flat_params.add(name)
            if isinstance(value, TensorRef):
                self._plain(rank, path, name, value)
            elif isinstance(value, Record) and value.name == "DTensor":
                self._dtensor(rank, path, name, value)
            elif isinstance(value, Record) and value.name == "ShardedTensor":
                self._sharded(rank, path, name, value)
            else:
                keys.discard(name)
                self.skipped.add(name)
        self.keys_by_rank[rank] = keys

    def replay(self, rank: int, path: str, archive) -> None:
        """Add rank file ``path`` whose pickle equals a template's but for its mesh
        coordinate (``archive.root`` is ``(template, coord)``; ``archive.data_offsets`` where each storage
        starts in this file): the same tensors, dtypes,
        global shapes, placements, local shapes and strides, so only each piece's offsets
        (placement arithmetic, cached per distinct tensor layout and coordinate) and its
        bytes' position in this file (``archive.storages``) are new."""
        tpl, coord = archive.root
        if coord is None:
            coord = tuple(_unravel(rank, tpl.mesh_shape))
        self.keys_by_rank[rank] = tpl.keys
        where, boxes, add = archive.data_offsets, self.box_cache, self.add
        for t, key, soff, itemsize, shape, stride, dtype, box in tpl.entries:
            byte_offset = where[key] + soff * itemsize
            if box is None:
                add(t, Piece(path, byte_offset, dtype, shape, stride, (0,) * len(shape), rank))
                continue
            got = boxes.get((box[0], coord))
            if got is None:
                _, gshape, mesh_shape, placements, _ = box
                got = boxes[(box[0], coord)] = local_box(gshape, mesh_shape, coord, placements)
            offsets, want = got
            if want != shape:
                self.layout.problems.append(Problem(
                    "shape-mismatch", f"{t.name}: local shard is {shape}, its placement "
                    f"{box[4]} on mesh {box[2]} at {coord} gives {want}", path))
                continue
            if 0 in want:
                continue  # an empty shard (Builder.add skips those too)
            add(t, Piece(path, byte_offset, dtype, shape, stride, offsets, rank, coord))

    def _plain(self, rank, path, name, ref: TensorRef) -> None:
        t = self.tensor(name, ref.shape, ref.dtype, "plain", path)
        self._check_fits(name, ref, path)
        if self.recording is not None:
            self.recording.append((t, ref, None))
        self.add(t, Piece(path, ref.byte_offset, ref.dtype, ref.shape, ref.stride,
                          (0,) * len(ref.shape), rank))

    def _check_fits(self, name, ref: TensorRef, path) -> None:
        if not ref.fits_storage():
            raise BadCheckpointError(f"{name}: view {ref.shape} at {ref.storage_offset} lies "
                                     "outside its storage", path)

    def _dtensor(self, rank, path, name, rec: Record) -> None:
        st = _state(rec)
        local, spec = st.get("_local_tensor"), st.get("_spec")
        if not isinstance(local, TensorRef) or not isinstance(spec, Record):
            raise BadCheckpointError(f"{name}: DTensor without a local tensor or spec", path)
        dtype = rec.args[0].name if rec.args and isinstance(rec.args[0], DType) else local.dtype
        gshape = tuple(rec.args[1]) if len(rec.args) > 1 else None
        meta = spec.get("tensor_meta")
        if isinstance(meta, Record) and meta.args:
            gshape = tuple(meta.args[0])
        mesh = spec.get("mesh")
        info = self.mesh_cache.get(id(mesh))  # tensors of a rank share one pickled mesh
        if info is None:
            info = self.mesh_cache[id(mesh)] = (_mesh_info(mesh), mesh)
        mesh_shape, names, coord = info[0]
        placements = list(spec.get("placements") or ())
        pstr = ", ".join(_placement_str(p) for p in placements)
        t = self.tensor(name, gshape, dtype, f"({pstr})" if len(placements) > 1 else pstr, path)
        if self.mesh is None:
            self.mesh = (mesh_shape, names)
        elif self.mesh != (mesh_shape, names) and not self.mesh_reported:
            self.mesh_reported = True
            self.layout.problems.append(Problem(
                "mesh-mismatch", f"{name}: device mesh {mesh_shape} {names} here, "
                f"{self.mesh[0]} {self.mesh[1]} elsewhere", path))
        if coord is None:
            coord = tuple(_unravel(rank, mesh_shape))
        for i, p in enumerate(placements):
            self.shard_dims_by_mesh_dim.setdefault(i, set()).add(p.name)
        try:
            offsets, shape = local_box(gshape, mesh_shape, coord, placements)
        except ValueError as e:
            self.layout.problems.append(Problem("unsupported-placement", f"{name}: {e}", path))
            return
        if shape != local.shape:
            self.layout.problems.append(Problem(
                "shape-mismatch", f"{name}: local shard is {local.shape}, its placement "
                f"{pstr} on mesh {mesh_shape} at {coord} gives {shape}", path))
            return
        self._check_fits(name, local, path)
        if local.dtype != dtype:
            self.layout.problems.append(Problem(
                "dtype-mismatch", f"{name}: local shard is {local.dtype}, the DTensor says "
                f"{dtype}", path))
            return
        if self.recording is not None:
            self.recording.append((t, local, (gshape, mesh_shape, tuple(placements), pstr)))
            self.hashes.add(spec.get("_hash"))
            self.hashes.add(mesh.get("_hash") if isinstance(mesh, Record) else None)
        self.add(t, Piece(path, local.byte_offset, local.dtype, local.shape, local.stride,
                          offsets, rank, coord))

    def _sharded(self, rank, path, name, rec: Record) -> None:
        self.recording = None
        st = rec.state
        if not (isinstance(st, tuple) and len(st) >= 2):
            raise BadCheckpointError(f"{name}: ShardedTensor without state", path)
        local_shards, meta = st[0], st[1]
        props = meta.get("tensor_properties")
        dtype = None
        if isinstance(props, Record) and isinstance(props.state, tuple) and props.state:
            dtype = props.state[0].name if isinstance(props.state[0], DType) else None
        if dtype is None:
            dtype = rec.args[0].name if rec.args and isinstance(rec.args[0], DType) else "F32"
        t = self.tensor(name, tuple(meta.get("size")), dtype, "ShardedTensor", path)
        for shard in local_shards or ():
            s = _state(shard)
            md, ref = _state(s["metadata"]), s["tensor"]
            offsets, sizes = tuple(md["shard_offsets"]), tuple(md["shard_sizes"])
            if tuple(ref.shape) != sizes:
                self.layout.problems.append(Problem(
                    "shape-mismatch", f"{name}: local shard is {ref.shape}, metadata says "
                    f"{sizes}", path))
                continue
            self._check_fits(name, ref, path)
            self.add(t, Piece(path, ref.byte_offset, ref.dtype, ref.shape, ref.stride,
                              offsets, rank))


def _key_ops(key: str) -> tuple[bytes, bytes]:
    """The pickle ops writing string ``key``: BINUNICODE and SHORT_BINUNICODE."""
    raw = key.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw, b"\x8c" + bytes([len(raw)]) + raw


_COORD_KEYS = _key_ops("_coordinate_on_dim")
#: torch's DeviceMesh also pickles the global rank that saved it (``_rank``) and the names of
#: this rank's process groups (``_dim_group_names``, one per mesh dim: HSDP's replica groups
#: differ between ranks); neither is used here
_RANK_KEYS = _key_ops("_rank")
_GROUP_KEYS = _key_ops("_dim_group_names")
_STR_ARGS = {"BINUNICODE": 5, "SHORT_BINUNICODE": 2}
_INT_ARGS = {"BININT1": (1, False), "BININT2": (2, False), "BININT": (4, True)}
_COORD_VALUE_OPS = frozenset({"BINPUT", "LONG_BINPUT", "MEMOIZE", "EMPTY_LIST", "MARK",
                              "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2",
                              "TUPLE3", *_INT_ARGS, *_STR_ARGS})


def _coord_spans(data: bytes, coord, keys=_COORD_KEYS) -> list[tuple[int, int, bool]] | None:
    """Where the pickle writes the mesh coordinate's integers: ``[(byte position, width,
    signed)]``, one per mesh dim, or None when it cannot be told for sure (the key
    ``_coordinate_on_dim`` of torch's DeviceMesh state absent or written twice, or its value
    not a plain list/tuple of small ints). ``[]`` when the mesh records no coordinate (older
    releases: it comes from the rank)."""
    import io
    import pickletools

    hits = [(k, data.find(k)) for k in keys]
    hits = [(k, i) for k, i in hits if i >= 0]
    if coord is None:
        return [] if not hits else None
    if len(hits) != 1 or data.find(hits[0][0], hits[0][1] + 1) >= 0:
        return None
    start = hits[0][1] + len(hits[0][0])
    spans = []
    try:
        window = io.BytesIO(data[start:start + 64 + 64 * len(coord)])
        for op, arg, pos in pickletools.genops(window):
            if op.name not in _COORD_VALUE_OPS or len(spans) == len(coord):
                break
            if op.name in _INT_ARGS:
                width, signed = _INT_ARGS[op.name]
                spans.append((start + pos + 1, width, signed, arg))
            elif op.name in _STR_ARGS:
                spans.append((start + pos + _STR_ARGS[op.name], len(arg.encode()), False, arg))
    except ValueError:
        return None
    if [a for *_, a in spans] != list(coord):
        return None
    return [(p, w, sg) for p, w, sg, _ in spans]


def _hash_spans(data: bytes, hashes) -> list[tuple[int, int, bool]] | None:
    """Where the pickle writes the given cached hashes (``DTensorSpec._hash``,
    ``DeviceMesh._hash``: they hash the mesh coordinate, so every rank file has its own): each
    is pickled as LONG1 with 8 bytes of a 64-bit hash, a pattern that occurs nowhere else by
    chance; every occurrence of it is one. None when a hash is written otherwise (a small
    value), so that its place cannot be told for sure."""
    import pickle

    spans = []
    for h in hashes:
        if h is None:
            continue
        if not isinstance(h, int):
            return None
        enc = pickle.encode_long(h)
        if len(enc) < 7:
            return None
        pat = b"\x8a" + bytes([len(enc)]) + enc
        at = data.find(pat)
        if at < 0:
            return None
        while at >= 0:
            spans.append((at + 2, len(enc), True))
            at = data.find(pat, at + len(pat))
    return spans


class _Template:
    """A fully parsed rank file of the run, for recognising the others: rank files of one
    FSDP2 run pickle the same state dict, byte for byte, but for the mesh coordinate (and
    local shapes where the even-chunk rule leaves a rank fewer rows: a different pickle,
    hence another template)."""

    def __init__(self, data: bytes, spans, other_spans, coord, mesh_shape, keys, recording,
                 storages):
        import numpy as np

        self.data = np.frombuffer(data, dtype=np.uint8)
        self.spans = spans
        self.coord = coord
        self.mesh_shape = mesh_shape
        self.keys = frozenset(keys)
        mask = np.zeros(len(data), dtype=bool)
        for p, w, _ in (*spans, *other_spans):
            mask[p:p + w] = True
        self.mask = mask
        from ..dtypes import ITEMSIZE
        from .torchsave import StorageSpecs

        keys = list(storages)
        self.specs = StorageSpecs(keys, np.asarray(
            [storages[k].numel * ITEMSIZE[storages[k].dtype] for k in keys], dtype=np.int64))

        # tensors with the same global shape and placements share their placement arithmetic
        layouts: dict[tuple, tuple] = {}
        self.entries = []
        for t, ref, box in recording:
            if box is not None:
                gshape, mshape, placements, pstr = box
                key = (gshape, mshape, tuple((p.name, p.get("dim")) for p in placements))
                box = layouts.setdefault(key, (key, gshape, mshape, placements, pstr))
            self.entries.append((t, ref.storage.key, ref.storage_offset, ITEMSIZE[ref.dtype],
                                 ref.shape, ref.stride, ref.dtype, box))

    def match(self, data: bytes):
        """``(self, coordinate)`` when ``data`` is this pickle but for the coordinate."""
        import numpy as np

        if len(data) != len(self.data):
            return None
        diff = np.frombuffer(data, dtype=np.uint8) != self.data
        if diff.any() and bool((diff & ~self.mask).any()):
            return None
        if not self.spans:
            return self, None
        coord = tuple(int.from_bytes(data[p:p + w], "little", signed=sg)
                      for p, w, sg in self.spans)
        return self, coord


class _Templates:
    """The templates seen so far in one folder (a few: one per distinct local-shape set and
    coordinate width)."""

    LIMIT = 16

    def __init__(self):
        self.items: list[_Template] = []
        self.last_data: bytes | None = None

    def reuse(self, data: bytes):
        self.last_data = data
        for i, tpl in enumerate(self.items):
            got = tpl.match(data)
            if got is not None:
                if i:  # ranks come in runs of one template: try the last one first
                    self.items.insert(0, self.items.pop(i))
                return got, tpl.specs
        return None

    def learn(self, b: "_Builder", archive, rank: int) -> None:
        """Make a template of the rank file just parsed fully, when it added no problem and
        its coordinate can be located in its pickle."""
        if b.recording is None or len(self.items) >= self.LIMIT or self.last_data is None:
            return
        if not isinstance(archive.root, dict) or b.skipped or b.flat_params:
            return
        meshes = {id(m) for _, m in b.mesh_cache.values()}
        coords = {info[2] for info, _ in b.mesh_cache.values()}
        if len(meshes) > 1 or len(coords) > 1 or len(b.keys_by_rank[rank]) != len(archive.root):
            return
        coord = next(iter(coords)) if coords else None
        mesh_shape = next(iter(b.mesh_cache.values()))[0][0] if b.mesh_cache else ()
        spans = _coord_spans(self.last_data, coord)
        if spans is None:
            return
        mesh_rank = next(iter(b.mesh_cache.values()))[1].get("_rank") if b.mesh_cache else None
        other = _coord_spans(self.last_data, (mesh_rank,) if isinstance(mesh_rank, int) else None,
                             _RANK_KEYS)
        groups = next(iter(b.mesh_cache.values()))[1].get("_dim_group_names") \
            if b.mesh_cache else None
        if groups is not None:
            names = _coord_spans(self.last_data, tuple(groups), _GROUP_KEYS) \
                if all(isinstance(g, str) for g in groups) else None
            if names is None or other is None:
                return
            other = other + names
        if other is None:
            return
        hashes = _hash_spans(self.last_data, b.hashes)
        if hashes is None:
            return
        self.items.append(_Template(self.last_data, spans, other + hashes, coord, mesh_shape,
                                    b.keys_by_rank[rank], b.recording, archive.storages))


def _unravel(rank: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(rank % n if n else 0)
        rank //= n or 1
    return list(reversed(out))


def _mesh_parallel(shape, names, kinds: dict[int, set[str]]) -> dict[str, int]:
    """Degrees of parallelism from the mesh: a dimension named like tp/pp/ep is that; one that
    shards some tensor is fsdp; one that only replicates is dp (HSDP's replica dimension)."""
    par: dict[str, int] = {}
    for i, n in enumerate(shape):
        name = (names[i] if names else "").lower()
        if name in ("tp", "pp", "ep", "cp"):
            kind = name
        elif "Shard" in kinds.get(i, set()):
            kind = "fsdp"
        else:
            kind = "dp"
        par[kind] = par.get(kind, 1) * n
    return par


def read(path: str) -> CheckpointLayout:
    """Read the layout of a per-rank FSDP folder (metadata only: the pickles, never tensor data).

    Problems found (missing ranks, mixed world sizes, fsdp_config.json disagreeing, unreadable
    files, ranks that disagree, pieces that do not tile a tensor) are recorded in
    ``layout.problems``; raises :class:`BadCheckpointError` only when no rank file exists.
    """
    root = Path(path)
    kind, groups = _rank_files(root)
    if not groups:
        raise BadCheckpointError("no model_world_size_*_rank_*.pt or "
                                 "pytorch_model_fsdp_*_rank*.bin files", str(root))
    layout = CheckpointLayout(format="fsdp", path=str(root), world_size=0)
    cfg_path = root / "fsdp_config.json"
    cfg_world = None
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
            cfg_world = int(cfg["world_size"])
            if cfg.get("FSDP_version"):
                layout.notes.append(f"FSDP version {cfg['FSDP_version']} (fsdp_config.json)")
        except (ValueError, KeyError, TypeError, OverflowError, AttributeError, OSError):
            layout.problems.append(Problem("bad-fsdp-config", "not a readable JSON object with "
                                           "an integer world_size", str(cfg_path)))
            cfg_world = None
    if kind == "verl":
        if len(groups) > 1:
            sizes = sorted(groups)
            layout.problems.append(Problem(
                "mixed-world-size", f"rank files of world sizes {sizes} in one folder", str(root)))
        world = cfg_world if cfg_world in groups else max(groups, key=lambda w: len(groups[w]))
        files = groups[world]
    else:
        files = groups[min(groups)]
        world = max(files) + 1
        layout.notes.append("accelerate per-rank files: world size taken from the rank numbers")
    if cfg_world is not None and cfg_world != world:
        layout.problems.append(Problem(
            "world-size-mismatch", f"fsdp_config.json says world size {cfg_world}, the files "
            f"say {world}", str(cfg_path)))
    elif cfg_world is None and kind == "verl":
        layout.notes.append(f"fsdp_config.json not found: world size {world} taken from the "
                            "file names")
    layout.world_size = world
    b = _Builder(layout)
    templates = _Templates()
    missing = [r for r in range(min(world, MAX_LISTED)) if r not in files]
    n_missing = world - sum(1 for r in files if r < world)
    for r in sorted(set(missing) | {r for r in files if r < world}):
        name = (f"model_world_size_{world}_rank_{r}.pt" if kind == "verl"
                else f"pytorch_model_fsdp_{min(groups)}_rank{r}.bin")
        fpath = files.get(r, str(root / name))
        sf = stat_file(fpath, r)
        layout.files.append(sf)
        if sf.status == "missing":
            if n_missing <= MAX_LISTED_PROBLEMS:
                layout.problems.append(Problem("missing-rank", f"rank {r} of {world} is "
                                               "missing", fpath))
            continue
        try:
            b.mesh_cache.clear()
            templates.last_data = None
            archive = read_torch_archive(fpath, reuse=templates.reuse)
            if isinstance(archive.root, tuple):  # recognised: same structure as a template
                b.replay(r, fpath, archive)
                continue
            n_problems = len(layout.problems)
            b.recording = []
            b.hashes = set()
            b.add_rank(r, fpath, archive.root)
            if len(layout.problems) == n_problems:
                templates.learn(b, archive, r)
            b.recording = None
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, fpath))
        except Exception as e:  # noqa: BLE001 - a damaged pickle can hold anything
            sf.status = "unreadable"
            layout.problems.append(Problem("unreadable-file", f"unexpected content "
                                           f"({type(e).__name__}: {e})", fpath))
    if n_missing > MAX_LISTED_PROBLEMS:
        layout.problems.append(Problem(
            "missing-rank", f"{n_missing} of {world} ranks are missing (e.g. ranks "
            f"{', '.join(map(str, missing[:8]))})", str(root)))
    for r in sorted(files):
        if r >= world:
            layout.problems.append(Problem("extra-rank", f"rank {r} is beyond world size {world}",
                                           files[r]))
    if b.mesh:
        layout.mesh_shape, layout.mesh_dim_names = b.mesh
        layout.parallel = _mesh_parallel(b.mesh[0], b.mesh[1], b.shard_dims_by_mesh_dim)
    elif world > 1:
        layout.parallel = {"fsdp": world}
    all_keys = set().union(*b.keys_by_rank.values()) if b.keys_by_rank else set()
    for r, keys in sorted(b.keys_by_rank.items()):
        if keys != all_keys:
            miss = sorted(all_keys - keys)
            layout.problems.append(Problem(
                "key-mismatch", f"rank {r} lacks {len(miss)} keys (e.g. {miss[0]})", files.get(r)))
    if b.skipped:
        layout.notes.append(f"{len(b.skipped)} non-tensor entries skipped")
    if b.flat_params:
        example = sorted(b.flat_params)[0]
        layout.problems.append(Problem(
            "fsdp1-local-state-dict", f"FSDP1 LOCAL_STATE_DICT rank files: {len(b.flat_params)} "
            f"flat parameters (e.g. {example}) hold the model's tensors flattened, and the files "
            "do not record their names or shapes; unsupported: save with "
            "StateDictType.SHARDED_STATE_DICT or FULL_STATE_DICT", str(root)))
    if not any(p.code in ("missing-rank", "unreadable-file", "truncated-file", "unsafe-pickle")
               for p in layout.problems):
        for t in layout.tensors.values():
            layout.problems.extend(coverage_problems(t))
    hf = root / "huggingface"
    attach_config(layout, hf if hf.is_dir() else None)
    return layout
