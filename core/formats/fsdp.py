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
from ..phases import phase, progressed, snapshot
from .common import attach_config, clean_key, problem_for, stat_file
from .torchsave import DirectoryCache, DType, Record, TensorRef, read_torch_archive

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


#: releases whose rank files were checked (tests/data/torch_releases/, one folder each)
CHECKED_RELEASES = ("2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15")

#: torch.save archives do not record the torch release that wrote them
UNKNOWN_RELEASE = ("a record layout this reader does not know (the file does not say which "
                   "torch release wrote it; files of torch "
                   f"{', '.join(CHECKED_RELEASES[:-1])} and {CHECKED_RELEASES[-1]} were checked)")


class UnknownRecordError(BadCheckpointError):
    """A rank file whose DTensor records have a layout this reader does not know."""


class MeshRecordError(ValueError):
    """A pickled DeviceMesh, placement or DTensorSpec whose layout this reader does not know
    (a torch release newer than the ones it was checked against); the message names the
    field."""


def _mesh_shape_from_layout(layout: Record) -> tuple[int, ...]:
    """Mesh shape from a pickled ``torch.distributed._mesh_layout._MeshLayout``.

    torch 2.13-2.15 keep ``axes``: one ``_FlatLayout`` per mesh dimension whose ``shape`` may
    be a (nested) tuple: the dimension's size is the product. torch 2.10-2.12 keep the CuTe
    pair ``shape``/``stride`` directly, one entry (an int or a nested tuple) per mesh
    dimension (torch/distributed/_mesh_layout.py of each release; checked on files of 2.10 to
    2.15)."""
    axes = layout.get("axes")
    if axes is not None:
        dims = []
        for ax in axes:
            s = ax.get("shape") if isinstance(ax, Record) else None
            if s is None:
                raise MeshRecordError(f"DeviceMesh._layout.axes holds {_kind(ax)}, not a "
                                      "_FlatLayout with a shape")
            dims.append(_prod(s, "DeviceMesh._layout.axes[].shape"))
        return tuple(dims)
    shape = layout.get("shape")
    if isinstance(shape, (tuple, list)):
        return tuple(_prod(s, "DeviceMesh._layout.shape") for s in shape)
    if isinstance(shape, int):
        return (shape,)
    raise MeshRecordError(f"DeviceMesh._layout ({layout.name}) has neither axes nor shape "
                          f"(fields: {_fields(layout)})")


def _prod(x, what: str) -> int:
    """Size of a CuTe shape: the product of its (nested) entries; ``()`` is a dim of size 1
    (``_FlatLayout`` drops dims of size 1 when it normalises)."""
    vals = list(_flatten(x))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in vals):
        raise MeshRecordError(f"{what} is {x!r}, not sizes")
    return math.prod(vals)


def _kind(x) -> str:
    return f"{x.module}.{x.name}" if isinstance(x, Record) else type(x).__name__


def _fields(rec: Record) -> str:
    st = _state(rec)
    return ", ".join(sorted(map(str, st))) if st else "none"


def _mesh_info(mesh: Record) -> tuple[tuple[int, ...], tuple[str, ...] | None, tuple[int, ...] | None]:
    """(mesh shape, dimension names, this rank's coordinate) from a pickled DeviceMesh
    (``DeviceMesh.__getstate__`` pickles its ``__dict__``; torch/distributed/device_mesh.py).

    Where each release keeps the shape: torch <= 2.9 a ``mesh`` tensor of the mesh's shape;
    torch 2.10-2.12 ``_layout`` = ``_MeshLayout(shape, stride)`` beside a flat ``_rank_map``;
    torch 2.13-2.15 ``_layout.axes`` (one ``_FlatLayout`` per dimension; 2.15 adds
    ``_preserve_rank_order``, the order of ranks in the process groups, not read). Names:
    ``mesh_dim_names`` (<= 2.9) or ``_mesh_dim_names``; coordinate: ``_coordinate_on_dim``
    (``None`` when the file's rank is outside the mesh). Raises :class:`MeshRecordError`
    naming the field for any other layout."""
    if not isinstance(mesh, Record) or mesh.name != "DeviceMesh":
        raise MeshRecordError(f"DTensorSpec.mesh is {_kind(mesh)}, not a DeviceMesh")
    st = _state(mesh)
    names = st.get("_mesh_dim_names", st.get("mesh_dim_names"))
    names = tuple(map(str, names)) if names else None
    coord = st.get("_coordinate_on_dim")
    coord = tuple(coord) if isinstance(coord, (tuple, list)) else None
    layout = st.get("_layout")
    if isinstance(layout, Record):
        shape = _mesh_shape_from_layout(layout)
    elif isinstance(st.get("mesh"), TensorRef):
        shape = tuple(st["mesh"].shape)
    else:  # a flat ``_rank_map`` alone does not give the shape (torch >= 2.10 keeps it 1-D)
        raise MeshRecordError(f"DeviceMesh record has no mesh tensor nor _layout (fields: "
                              f"{_fields(mesh)})")
    if names is not None and len(names) != len(shape):
        raise MeshRecordError(f"DeviceMesh names {names} for a {len(shape)}-D mesh {shape}")
    if coord is not None and (len(coord) != len(shape) or not all(
            isinstance(c, int) and 0 <= c < n for c, n in zip(coord, shape))):
        raise MeshRecordError(f"DeviceMesh._coordinate_on_dim {coord} lies outside the mesh "
                              f"{shape}")
    return shape, names, coord


def _flatten(x):
    if isinstance(x, (tuple, list)):
        for i in x:
            yield from _flatten(i)
    else:
        yield x


def _placement_str(p: Record) -> str:
    if not isinstance(p, Record):
        return type(p).__name__
    if p.name == "_StridedShard":
        return f"StridedShard({p.get('dim')}, {p.get('split_factor')})"
    if p.name == "Shard":
        return f"Shard({p.get('dim')})"
    return f"{p.name}()"


SHARD_KINDS = ("Shard", "_StridedShard")


def shard_orders(ndim: int, mesh_shape: tuple[int, ...], placements: list[Record],
                 recorded=None) -> dict[int, list[int]]:
    """For each sharded tensor dim, the mesh dims that shard it in the order they apply.

    Default: left to right. ``_StridedShard(d, split_factor=sf)`` on mesh dim ``i`` means
    that before it, ``d`` was already cut into ``sf`` pieces by mesh dims to its right: it
    applies after those (torch/distributed/tensor/_dtensor_spec.py,
    ``_maybe_convert_StridedShard_to_shard_order``, placement_types.py ``_StridedShard``;
    FSDP2 over TP gives ``(_StridedShard(0, tp), Shard(0))``: cut into ``tp`` chunks, each
    cut into ``dp`` pieces). Without a ``_StridedShard``, a recorded ``shard_order``
    (``ShardOrderEntry(tensor_dim, mesh_dims)``, in torch 2.10-2.12 files) gives the order. Raises
    :class:`MeshRecordError` for placements or orders this reader does not know."""
    order: dict[int, list[int]] = {}
    if len(placements) != len(mesh_shape):
        raise MeshRecordError(f"{len(placements)} placements for a {len(mesh_shape)}-D mesh")
    for p in placements:
        if not isinstance(p, Record) or p.name not in SHARD_KINDS + ("Replicate",):
            if isinstance(p, Record) and "Partial" in p.name:
                raise MeshRecordError(f"placement {p.name} (a pending reduction, not stored "
                                      "weights) cannot be merged")
            raise MeshRecordError(f"placement {_kind(p)} is not supported")
        if p.name in SHARD_KINDS:
            d = p.get("dim")
            if not isinstance(d, int) or not -ndim <= d < ndim:
                raise MeshRecordError(f"placement {_placement_str(p)} of a {ndim}-D tensor")
    def dim_of(p):
        d = p.get("dim")
        return d + ndim if d < 0 else d

    if any(p.name == "_StridedShard" for p in placements):
        for i in reversed(range(len(placements))):
            p = placements[i]
            if p.name not in SHARD_KINDS:
                continue
            sf = p.get("split_factor") if p.name == "_StridedShard" else 1
            dims = order.setdefault(dim_of(p), [])
            acc, placed = 1, False
            for k in range(len(dims) + 1):
                if acc == sf:
                    dims.insert(k, i)
                    placed = True
                    break
                if k < len(dims):
                    acc *= mesh_shape[dims[k]]
            if not placed:
                raise MeshRecordError(f"placement {_placement_str(p)} on mesh dim {i}: its "
                                      f"split factor matches no order of the mesh {mesh_shape}")
        return order
    for i, p in enumerate(placements):
        if p.name in SHARD_KINDS:
            order.setdefault(dim_of(p), []).append(i)
    if recorded:
        for e in recorded:
            args = e.args if isinstance(e, Record) else e
            if not (isinstance(args, (tuple, list)) and len(args) == 2):
                raise MeshRecordError(f"DTensorSpec.shard_order entry {_kind(e)} is not "
                                      "(tensor_dim, mesh_dims)")
            td, mds = args[0], tuple(args[1])
            if sorted(mds) != sorted(order.get(td, [])):
                raise MeshRecordError(f"DTensorSpec.shard_order {td}: {mds} disagrees with "
                                      "the placements")
            order[td] = list(mds)
    return order


def local_box(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
              placements: list[Record], recorded_order=None
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) of the shard held at mesh coordinate ``coord``.

    DTensor's chunk rule (torch ``compute_local_shape_and_global_offset``; ``Shard`` follows
    ``torch.chunk``): each tensor dim is cut by the mesh dims that shard it, in the order of
    :func:`shard_orders`; a cut over ``n`` ranks gives each ``ceil(size/n)`` elements, the
    last ones fewer or none, and the next cut divides the piece already taken. Raises
    :class:`MeshRecordError` (a ValueError) for placements it cannot place (``Partial``).
    """
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    for d, mesh_dims in shard_orders(len(global_shape), mesh_shape, placements,
                                     recorded_order).items():
        for i in mesh_dims:
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
        #: placement kinds seen per mesh dim (keyed by dim name when the mesh names them)
        self.shard_dims_by_mesh_dim: dict[int | str, set[str]] = {}
        self.skipped: set[str] = set()
        self.mesh_reported = False
        self.seen: dict[tuple, Piece] = {}
        #: (tensor, kept piece, identical-place piece of another rank): replica copies
        self.copies: list[tuple[str, Piece, Piece]] = []
        #: rank -> the mesh coordinates of its shards (for :func:`_duplicate_ranks`)
        self.coords: dict[int, set] = {}
        self.mesh_cache: dict[int, tuple] = {}
        self.flat_params: set[str] = set()
        #: what the rank file being parsed holds, for :class:`_Template` (None: not
        #: recording, or not reusable: ShardedTensors record per-rank offsets in the pickle)
        self.recording: list | None = None
        #: the cached ``_hash`` values its DTensorSpecs and DeviceMesh pickle (they may hash
        #: the mesh coordinate, so that every rank file has its own)
        self.hashes: set = set()

    def kinds_by_dim(self) -> dict[int, set[str]]:
        """Placement kinds seen per dim of the checkpoint's mesh (``self.mesh``)."""
        names = self.mesh[1] if self.mesh else None
        out: dict[int, set[str]] = {}
        for i in range(len(self.mesh[0]) if self.mesh else 0):
            out[i] = set(self.shard_dims_by_mesh_dim.get(i, set())) | (
                self.shard_dims_by_mesh_dim.get(names[i], set()) if names else set())
        return out

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
        if piece.coord is not None and piece.rank is not None:
            self.coords.setdefault(piece.rank, set()).add(piece.coord)
        key = (t.name, piece.global_offsets, piece.shape)
        first = self.seen.get(key)
        if first is not None:  # replicas (HSDP, replicated buffers): keep the first copy
            self.copies.append((t.name, first, piece))
            return
        self.seen[key] = piece
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

    def replay(self, rank: int, path: str, tpl: "_Template", coord, offsets: dict) -> None:
        """Add rank file ``path`` whose pickle is ``tpl``'s but for the values
        :class:`_Template` masks (its mesh coordinate ``coord``, None when the mesh records
        none, and values unused here): the same tensors, dtypes, global shapes, placements,
        local shapes and strides as the template's file, so only each piece's global offsets
        (placement arithmetic at ``coord``, cached per placement and coordinate) and where
        its storage starts in this file (``offsets``, located and checked by
        :func:`read_torch_archive`) are new. Adds the problems a full parse would."""
        if coord is None:
            coord = tuple(_unravel(rank, tpl.mesh_shape))
        self.keys_by_rank[rank] = tpl.keys
        if tpl.boxes:  # DTensors: all at this coordinate
            self.coords.setdefault(rank, set()).add(coord)
        add, seen, copies = self.add, self.seen, self.copies
        # placement arithmetic once per distinct placement of the file (a few), not per tensor
        per_box: list = []
        for i, (gshape, mesh_shape, placements, order, _) in enumerate(tpl.boxes):
            got = tpl.box_cache.get((i, coord))
            if got is None:
                try:
                    got = local_box(gshape, mesh_shape, coord, placements, order)
                except MeshRecordError as e:  # the template's own coordinate placed it
                    got = e
                tpl.box_cache[(i, coord)] = got
            per_box.append(got)
        # Pieces made without the frozen dataclass's __init__ (one object.__setattr__ per
        # field: half of this loop's time at 256 ranks x 1000 tensors); the same objects.
        # When every placement gives the template's local shape (``checked``), the file holds
        # exactly the template's plain tensors and non-empty shards: no per-tensor checks.
        new, piece_cls = object.__new__, Piece
        checked = all(per_box[box].__class__ is tuple and per_box[box][1] == shape
                      for box, shape in tpl.shapes)
        if checked:
            for t, key, start, shape, stride, dtype, _, _ in tpl.plain:
                add(t, Piece(path, offsets[key] + start, dtype, shape, stride,
                             (0,) * len(shape), rank))
        for t, key, start, shape, stride, dtype, box, empty in (
                tpl.shards if checked else tpl.entries):
            if not checked:  # name each problem, in the file's order
                if box is None:  # a plain tensor (a buffer saved whole on every rank)
                    add(t, Piece(path, offsets[key] + start, dtype, shape, stride,
                                 (0,) * len(shape), rank))
                    continue
                got = per_box[box]
                if got.__class__ is not tuple:
                    self.layout.problems.append(Problem("unsupported-placement",
                                                        f"{t.name}: {got}", path))
                    continue
                if got[1] != shape:
                    gshape, mesh_shape, _, _, pstr = tpl.boxes[box]
                    self.layout.problems.append(Problem(
                        "shape-mismatch", f"{t.name}: local shard is {shape}, its placement "
                        f"{pstr} on mesh {mesh_shape} at {coord} gives {got[1]}", path))
                    continue
                if empty:
                    continue  # an empty shard (``add`` skips those too)
            goff = per_box[box][0]
            piece = new(piece_cls)
            piece.__dict__.update(file=path, byte_offset=offsets[key] + start, dtype=dtype,
                                  shape=shape, stride=stride, global_offsets=goff, rank=rank,
                                  coord=coord, archive=None)
            k = (t.name, goff, shape)
            first = seen.get(k)
            if first is None:  # what ``add`` does, inline: many files x many tensors
                seen[k] = piece
                t.pieces.append(piece)
            else:
                copies.append((t.name, first, piece))

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
            try:
                info = self.mesh_cache[id(mesh)] = (_mesh_info(mesh), mesh)
            except MeshRecordError as e:
                raise UnknownRecordError(f"{name}: {e}; {UNKNOWN_RELEASE}", path) from None
        mesh_shape, names, coord = info[0]
        placements = list(spec.get("placements") or ())
        if gshape is None or len(gshape) == 0 and placements and any(
                isinstance(p, Record) and p.name in SHARD_KINDS for p in placements):
            raise UnknownRecordError(f"{name}: DTensorSpec without tensor_meta (fields: "
                                     f"{_fields(spec)}); {UNKNOWN_RELEASE}", path)
        pstr = ", ".join(_placement_str(p) for p in placements)
        t = self.tensor(name, gshape, dtype, f"({pstr})" if len(placements) > 1 else pstr, path)
        # A submesh (e.g. FSDP2's ``dp`` mesh of a (dp, tp) world, holding the parameters TP
        # left whole) keeps its root in ``_root_mesh`` (torch 2.10+); older releases keep
        # no link, so a named mesh whose dims are named dims of the same sizes in another
        # mesh of the file is taken as its slice. Tensors on either are one checkpoint.
        root = _state(mesh).get("_root_mesh")
        level = (mesh_shape, names)
        if isinstance(root, Record) and root is not mesh:
            rinfo = self.mesh_cache.get(id(root))
            if rinfo is None:
                try:
                    rinfo = self.mesh_cache[id(root)] = (_mesh_info(root), root)
                except MeshRecordError as e:
                    raise UnknownRecordError(f"{name}: _root_mesh: {e}; {UNKNOWN_RELEASE}",
                                             path) from None
            if rinfo[0][:2] != level:
                level = rinfo[0][:2]
                if coord is None or not _is_slice((mesh_shape, names), level):
                    raise UnknownRecordError(
                        f"{name}: DeviceMesh slice {mesh_shape} {names} of {level[0]} "
                        f"{level[1]} without named dims or _coordinate_on_dim; "
                        f"{UNKNOWN_RELEASE}", path)
        if self.mesh is None or _is_slice(self.mesh, level):
            self.mesh = level
        elif self.mesh != level and not _is_slice(level, self.mesh) and not self.mesh_reported:
            self.mesh_reported = True
            self.layout.problems.append(Problem(
                "mesh-mismatch", f"{name}: device mesh {level[0]} {level[1]} here, "
                f"{self.mesh[0]} {self.mesh[1]} elsewhere", path))
        if coord is None:
            coord = tuple(_unravel(rank, mesh_shape))
        for i, p in enumerate(placements):
            self.shard_dims_by_mesh_dim.setdefault(names[i] if names else i, set()).add(
                ("Shard" if p.name in SHARD_KINDS else p.name) if isinstance(p, Record)
                else _kind(p))
        try:
            offsets, shape = local_box(gshape, mesh_shape, coord, placements,
                                       spec.get("shard_order"))
        except MeshRecordError as e:
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
            self.recording.append((t, local, (gshape, mesh_shape, tuple(placements),
                                              spec.get("shard_order"), pstr)))
            self.hashes.add(spec.get("_hash"))
            self.hashes.add(_state(mesh).get("_hash"))
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
        # TensorProperties.__getstate__ (torch/distributed/_shard/sharded_tensor/metadata.py):
        # (dtype, layout, requires_grad, memory_format, pin_memory), + strides from torch 2.15
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


def _is_slice(a: tuple, b: tuple) -> bool:
    """True when mesh ``a`` (shape, names) is a proper slice of mesh ``b``: every dim of ``a``
    is named and is a dim of ``b`` of the same name and size."""
    (ashape, anames), (bshape, bnames) = a, b
    if not anames or not bnames or len(ashape) >= len(bshape):
        return False
    return all(n in bnames and bshape[bnames.index(n)] == s for n, s in zip(anames, ashape))


def _key_ops(key: str) -> tuple[bytes, bytes]:
    """The pickle ops that write string ``key``: BINUNICODE and SHORT_BINUNICODE."""
    raw = key.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw, b"\x8c" + bytes([len(raw)]) + raw


#: DeviceMesh state keys whose values differ between the rank files of one run
#: (torch/distributed/device_mesh.py, ``DeviceMesh.__getstate__`` pickles ``__dict__``):
#: this rank's mesh coordinate, the global rank that saved it, and the names of its process
#: groups (one per mesh dim: HSDP's replica groups differ between ranks). Only the
#: coordinate is used.
_COORD_KEYS = _key_ops("_coordinate_on_dim")
_RANK_KEYS = _key_ops("_rank")
_GROUP_KEYS = _key_ops("_dim_group_names")
_STR_ARGS = {"BINUNICODE": 5, "SHORT_BINUNICODE": 2}
_INT_ARGS = {"BININT1": (1, False), "BININT2": (2, False), "BININT": (4, True)}
_VALUE_OPS = frozenset({"BINPUT", "LONG_BINPUT", "MEMOIZE", "EMPTY_LIST", "MARK", "APPEND",
                        "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
                        *_INT_ARGS, *_STR_ARGS})


def _value_spans(data: bytes, value, keys) -> list[tuple[int, int, bool]] | None:
    """Where the pickle writes ``value`` (a tuple of small ints or of strings), the value
    of the state key ``keys`` names (:func:`_key_ops`): ``[(byte position, width, signed)]``
    of each item's bytes, or None when it cannot be told for sure (the key absent or
    written twice, or its value not a plain list/tuple of ints/strings equal to ``value``).
    ``value`` None: ``[]`` when the key is absent, else None."""
    import io
    import pickletools

    hits = [(k, data.find(k)) for k in keys]
    hits = [(k, i) for k, i in hits if i >= 0]
    if value is None:
        return [] if not hits else None
    if len(hits) != 1 or data.find(hits[0][0], hits[0][1] + 1) >= 0:
        return None
    start = hits[0][1] + len(hits[0][0])
    spans = []
    try:
        window = io.BytesIO(data[start:start + 64 + 300 * len(value)])
        for op, arg, pos in pickletools.genops(window):
            if op.name not in _VALUE_OPS or len(spans) == len(value):
                break
            if op.name in _INT_ARGS:
                width, signed = _INT_ARGS[op.name]
                spans.append((start + pos + 1, width, signed, arg))
            elif op.name in _STR_ARGS:
                spans.append((start + pos + _STR_ARGS[op.name], len(arg.encode()), False, arg))
    except ValueError:
        return None
    if [a for *_, a in spans] != list(value):
        return None
    return [(q, w, sg) for q, w, sg, _ in spans]


def _hash_spans(data: bytes, hashes) -> list[tuple[int, int, bool]] | None:
    """Where the pickle writes the cached hashes ``hashes`` (``DTensorSpec._hash``,
    ``DeviceMesh._hash``, None when not cached): each is pickled as LONG1 with the 8 bytes
    of a 64-bit hash, a pattern that occurs nowhere else by chance; every occurrence is
    one. None when a hash is written otherwise (a small value: its place is not certain)."""
    import pickle

    spans = []
    for h in hashes:
        if h is None:
            continue
        if not isinstance(h, int) or isinstance(h, bool):
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
    """A fully parsed rank file of the run, to recognise the others: the rank files of one
    FSDP2 run pickle the same state dict, byte for byte, but for the DeviceMesh values
    :data:`_COORD_KEYS`, :data:`_RANK_KEYS`, :data:`_GROUP_KEYS` and cached hashes (and
    local shapes where the even-chunk rule leaves a rank fewer rows: another pickle, hence
    another template). A file whose pickle equals the template's outside those bytes holds
    the same records, so its layout follows from the template's and its own coordinate.

    ``entries``: per tensor ``(TensorInfo, storage key, byte offset in the storage, local
    shape, stride, dtype, placement index or None for a plain tensor, empty)``; ``boxes``: per
    distinct placement ``(global shape, mesh shape, placements, shard order, text)``."""

    def __init__(self, data: bytes, coord_spans, masked, mesh_shape, keys, recording,
                 storages):
        from ..dtypes import ITEMSIZE

        self.data = data
        self.coord_spans = coord_spans
        self.mesh_shape = mesh_shape
        self.keys = frozenset(keys)
        # the unmasked stretches of the pickle, compared byte for byte
        cuts, pos = [], 0
        for at, width, _ in sorted((*coord_spans, *masked)):
            if at > pos:
                cuts.append((pos, at))
            pos = max(pos, at + width)
        cuts.append((pos, len(data)))
        self.cuts = cuts
        index: dict[tuple, int] = {}
        self.boxes: list[tuple] = []
        #: placement arithmetic of the files replayed: (placement index, coordinate) -> box
        self.box_cache: dict[tuple, tuple] = {}
        self.entries = []
        for t, ref, box in recording:
            if box is not None:
                gshape, mshape, placements, order, pstr = box
                key = (gshape, mshape, tuple((p.name, p.get("dim"), p.get("split_factor"))
                                             for p in placements), pstr,
                       tuple(e.args if isinstance(e, Record) else e for e in order or ()))
                if key not in index:
                    index[key] = len(self.boxes)
                    self.boxes.append(box)
                box = index[key]
            self.entries.append((t, ref.storage.key, ref.storage_offset * ITEMSIZE[ref.dtype],
                                 ref.shape, ref.stride, ref.dtype, box, 0 in ref.shape))
        # every storage the pickle names is checked in each file, as the full parse does
        self.needs = [(k, ref.numel * ITEMSIZE[ref.dtype]) for k, ref in storages.items()]
        #: the distinct (placement index, local shape) pairs of the DTensors: a file whose
        #: placements give each its shape holds exactly the template's non-empty pieces,
        #: ``shards`` (in the file's order), and :meth:`_Builder.replay` checks no tensor
        #: one by one
        self.shapes = sorted({(e[6], e[3]) for e in self.entries if e[6] is not None})
        self.shards = [e for e in self.entries if e[6] is not None and not e[7]]
        self.plain = [e for e in self.entries if e[6] is None]

    def match(self, data: bytes):
        """This file's mesh coordinate (None when the mesh records none) when ``data`` is
        this template's pickle but for the masked values, else False. A coordinate outside
        the mesh is no match (the full parse names the problem)."""
        mine = self.data
        if len(data) != len(mine):
            return False
        for a, b in self.cuts:
            if data[a:b] != mine[a:b]:
                return False
        if not self.coord_spans:
            return None
        coord = tuple(int.from_bytes(data[q:q + w], "little", signed=sg)
                      for q, w, sg in self.coord_spans)
        if not all(0 <= c < n for c, n in zip(coord, self.mesh_shape)):
            return False
        return coord


class _Templates:
    """The templates of one folder's rank files (a few: one per distinct set of local
    shapes and width of the coordinate's integers)."""

    LIMIT = 16

    def __init__(self):
        self.items: list[_Template] = []
        self.data: bytes | None = None
        self.hit: tuple | None = None

    def reuse(self, data: bytes):
        """The hook of :func:`read_torch_archive`: ``(root, storages)`` for a known pickle."""
        self.data, self.hit = data, None
        for i, tpl in enumerate(self.items):
            coord = tpl.match(data)
            if coord is not False:
                if i:  # ranks come in runs of one template: try the last one first
                    self.items.insert(0, self.items.pop(i))
                self.hit = (tpl, coord)
                return self.hit, tpl.needs
        return None

    def learn(self, b: "_Builder", rank: int, storages: dict) -> None:
        """Make a template of the rank file just parsed in full (``self.data``; its
        ``storages``) when it added no problem, holds DTensors on one mesh (or plain tensors
        only), and every per-rank value of its mesh is found in its pickle. A template only
        saves time: when in doubt, none is made."""
        try:
            self._learn(b, rank, storages)
        except Exception:  # noqa: BLE001 - unusual records: every file is parsed in full
            pass

    def _learn(self, b: "_Builder", rank: int, storages: dict) -> None:
        data = self.data
        if b.recording is None or len(self.items) >= self.LIMIT or data is None:
            return
        if b.flat_params or len(b.mesh_cache) > 1:
            return
        if b.mesh_cache:
            (mesh_shape, _, coord), mesh = next(iter(b.mesh_cache.values()))
            st = _state(mesh)
        else:
            mesh_shape, coord, st = (), None, {}
        spans = _value_spans(data, coord, _COORD_KEYS)
        mesh_rank = st.get("_rank")
        other = _value_spans(data, (mesh_rank,) if isinstance(mesh_rank, int) else None,
                             _RANK_KEYS)
        groups = st.get("_dim_group_names")
        names = _value_spans(data, tuple(groups) if isinstance(groups, (list, tuple)) and all(
            isinstance(g, str) for g in groups) else None, _GROUP_KEYS)
        hashes = _hash_spans(data, b.hashes)
        if spans is None or other is None or names is None or hashes is None:
            return
        self.items.append(_Template(data, spans, other + names + hashes, mesh_shape,
                                    b.keys_by_rank[rank], b.recording, storages))


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


def _serve_from_replicas(layout: CheckpointLayout, b: _Builder, world: int,
                         missing: list[int], replica_dims: list[int]) -> None:
    """HSDP with rank files missing: the mesh dims in ``replica_dims`` hold identical copies
    (every tensor is ``Replicate`` there), so a lost rank is no loss while another replica
    holds each of its shards. When every tensor is still tiled exactly, the missing ranks
    become warnings naming the replica that served them, after checking that the copies
    present agree byte for byte; otherwise the coverage gaps (naming each tensor) stay
    errors beside the missing ranks."""
    gaps = [p for t in layout.tensors.values() for p in coverage_problems(t)]
    if gaps:
        layout.problems.insert(0, Problem(
            "lost-shard", f"ranks {', '.join(map(str, missing[:8]))} of {world} are missing "
            f"and no HSDP replica present holds all their shards ({len(gaps)} tensors lack a "
            f"piece, e.g. {gaps[0].message})", layout.path))
        layout.problems.extend(gaps)
        return
    shape = layout.mesh_shape
    present = {f.rank for f in layout.files if f.status != "missing"}
    coords = {r: tuple(_unravel(r, shape)) for r in range(world)}
    served = []
    for r in missing:
        same = [q for q in sorted(present) if all(
            coords[q][i] == coords[r][i] for i in range(len(shape)) if i not in replica_dims)]
        served.append(f"rank {r} from rank {same[0]}" if same else f"rank {r}")
    for p in layout.problems:
        if p.code == "missing-rank":
            p.severity = "warning"
            p.message += " (HSDP: another replica holds its shards)"
    bad = _disagreeing_copies(b.copies)
    if bad:
        layout.problems.append(Problem(
            "replica-mismatch", f"{bad[0]}: the HSDP replicas present differ, so the copies "
            f"that stand in for the missing ranks cannot be trusted ({len(bad)} tensors differ)",
            layout.path))
        return
    layout.notes.append(f"HSDP: {len(missing)} of {world} rank files missing; every shard has a "
                        f"copy on another replica ({'; '.join(served[:8])}); the "
                        f"{len(b.copies)} replica copies present agree byte for byte")


def _replicas_disagreeing(layout: CheckpointLayout, copies: list[tuple[str, Piece, Piece]],
                          directories=None) -> None:
    """HSDP replicas whose storage records differ: for each replica copy that fills a whole
    storage record (a DTensor's local shard is saved as its own storage), the two records'
    CRC-32 in the zip directories (no data read; the CRC-32 is of the record's bytes, so two
    copies of one shard agree). A rank file of another run, or changed since, is then a
    ``replica-mismatch`` error naming both files: the merge would take one of the two at
    random. A copy that is a view into a larger storage is left to ``--deep``
    (:mod:`core.deep`), which compares the bytes."""
    from ..integrity import storage_crcs

    records: dict[str, dict[int, tuple[int, int]]] = {}

    def record(p: Piece):
        if p.file not in records:
            records[p.file] = storage_crcs(p.file, directories)
        return records[p.file].get(p.byte_offset)

    pairs: dict[tuple[str, str], list[str]] = {}
    for name, a, c in copies:
        if a.file == c.file or a.archive is not None or c.archive is not None:
            continue
        ra, rc = record(a), record(c)
        if (ra is None or rc is None or ra[0] != a.nbytes or rc[0] != c.nbytes
                or ra[1] == rc[1]):
            continue
        pairs.setdefault(tuple(sorted((a.file, c.file))), []).append(name)
    for (fa, fc), names in sorted(pairs.items()):
        layout.problems.append(Problem(
            "replica-mismatch", f"holds other values than {Path(fc).name}, its HSDP replica, "
            f"for {len(names)} tensor(s) (e.g. {names[0]}; their storage records' CRC-32 "
            "differ): one of the two is from another run or was changed since; the merge "
            "would take one of them", fa))


def _disagreeing_copies(copies: list[tuple[str, Piece, Piece]]) -> list[str]:
    """Names of tensors whose replica pieces differ in their bytes (contiguous pieces are
    compared as raw bytes; others element row by row through their strides)."""
    from ..dtypes import ITEMSIZE

    from ..execute import _piece_bytes, _Sources  # the merge's strided reader (numpy)

    bad: list[str] = []
    handles: dict[str, object] = {}
    sources = _Sources()
    try:
        for name, a, c in copies:
            if name in bad or a.dtype != c.dtype:
                bad += [] if name in bad else [name]
                continue
            size = ITEMSIZE[a.dtype]
            if a.contiguous and c.contiguous:
                if not _same_bytes(handles, a, c, a.numel * size):
                    bad.append(name)
            elif (_piece_bytes(a, sources).tobytes()
                  != _piece_bytes(c, sources).tobytes()):
                bad.append(name)
    finally:
        for f in handles.values():
            f.close()
        sources.close()
    return bad


def _handle(handles: dict, path: str):
    if path not in handles:
        handles[path] = open(path, "rb")
    return handles[path]


def _same_bytes(handles: dict, a: Piece, c: Piece, nbytes: int, block: int = 1 << 24) -> bool:
    fa, fc = _handle(handles, a.file), _handle(handles, c.file)
    for start in range(0, nbytes, block):
        n = min(block, nbytes - start)
        fa.seek(a.byte_offset + start)
        fc.seek(c.byte_offset + start)
        if fa.read(n) != fc.read(n):
            return False
    return True


def _duplicate_ranks(layout: CheckpointLayout, files: dict[int, str],
                     copies: list[tuple[str, Piece, Piece]],
                     coords: dict[int, set]) -> bool:
    """A rank file that holds the same shards at the same device-mesh coordinates as another
    rank's file (a copy of that file under another rank's name: ``cp rank_0 rank_1`` when
    restoring, a wrong file sent by a transfer). Every DTensor records its mesh coordinate, so
    two ranks of one save never agree on all of them (HSDP replicas differ on the replicate
    dimension, TP ranks on the TP one). Adds one ``duplicate-rank`` error per copy (before
    the coverage gaps it causes, which are then not listed); returns True when any.

    ``coords``: rank -> the mesh coordinates of its shards (or more), as the reader saw
    them go by. Two ranks can only agree when the sets of
    coordinates of their shards do, so the shards themselves are compared only for ranks
    that share their coordinate set with another rank (none, in a sound checkpoint): the
    256 x 1000 shards of a big run are not walked."""
    def held():
        for name, t in layout.tensors.items():
            for pc in t.pieces:
                yield name, pc
        for name, _, pc in copies:  # copies: same place
            yield name, pc

    by_coords: dict[frozenset, list[int]] = {}
    for r, cs in coords.items():
        by_coords.setdefault(frozenset(cs), []).append(r)
    suspects = {r for rs in by_coords.values() if len(rs) > 1 for r in rs}
    if not suspects:
        return False
    sig: dict[int, list] = {}
    for name, pc in held():
        if pc.rank in suspects and pc.coord is not None:
            sig.setdefault(pc.rank, []).append((name, pc.coord, pc.global_offsets))
    seen: dict[tuple, int] = {}
    found = False
    for r in sorted(sig):
        key = tuple(sorted(sig[r]))
        if key in seen:
            found = True
            layout.problems.append(Problem(
                "duplicate-rank", f"holds the same shards as rank {seen[key]}'s file "
                f"({Path(files[seen[key]]).name}): the same device-mesh coordinates, not rank "
                f"{r}'s; a copy of that file under this rank's name? rank {r}'s shards are "
                "missing", files.get(r)))
        else:
            seen[key] = r
    return found


def read(path: str, present_only: bool = False) -> CheckpointLayout:
    """Read the layout of a per-rank FSDP folder (metadata only: the pickles, never tensor data).

    ``present_only``: read the rank files that are here and judge nothing that needs the
    others (no ``missing-rank``, ``key-mismatch`` or coverage problems): the set is judged on
    the union of several nodes' layouts (core/distributed.py, ``merge --distributed``).

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
    templates, directories = _Templates(), DirectoryCache()
    missing = [r for r in range(min(world, MAX_LISTED)) if r not in files]
    n_missing = world - sum(1 for r in files if r < world)
    ranks = sorted(set(missing) | {r for r in files if r < world})
    for i, r in enumerate(ranks):
        # between files: counts, problems so far, a preview once a file gave tensors (and
        # cancellation) for a front end watching (core/phases.py)
        progressed(i, len(ranks), layout,
                   (lambda: _preview(layout, b, root)) if layout.tensors else None)
        name = (f"model_world_size_{world}_rank_{r}.pt" if kind == "verl"
                else f"pytorch_model_fsdp_{min(groups)}_rank{r}.bin")
        fpath = files.get(r, str(root / name))
        sf = stat_file(fpath, r)
        if present_only and sf.status == "missing":
            continue
        layout.files.append(sf)
        if sf.status == "missing":
            if n_missing <= MAX_LISTED_PROBLEMS:
                layout.problems.append(Problem("missing-rank", f"rank {r} of {world} is "
                                               "missing", fpath))
            continue
        phase(f"reading rank files {len(layout.files)}/{world}")
        try:
            b.mesh_cache.clear()
            archive = read_torch_archive(fpath, reuse=templates.reuse, directories=directories)
            if archive.offsets is not None:  # the pickle of a rank file parsed before
                tpl, coord = archive.root
                b.replay(r, fpath, tpl, coord, archive.offsets)
                continue
            n_problems = len(layout.problems)
            b.recording, b.hashes = [], set()
            b.add_rank(r, fpath, archive.root)
            if len(layout.problems) == n_problems:
                templates.learn(b, r, archive.storages)
            b.recording = None
        except UnknownRecordError as e:
            sf.status = "unreadable"
            layout.problems.append(Problem("unsupported-record", e.message, fpath))
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, fpath))
        except Exception as e:  # noqa: BLE001 - a damaged pickle can hold anything
            sf.status = "unreadable"
            layout.problems.append(Problem("unreadable-file", f"unexpected content "
                                           f"({type(e).__name__}: {e})", fpath))
    progressed(len(ranks), len(ranks), layout)
    if n_missing > MAX_LISTED_PROBLEMS and not present_only:
        layout.problems.append(Problem(
            "missing-rank", f"{n_missing} of {world} ranks are missing (e.g. ranks "
            f"{', '.join(map(str, missing[:8]))})", str(root)))
    for r in sorted(files):
        if r >= world:
            layout.problems.append(Problem("extra-rank", f"rank {r} is beyond world size {world}",
                                           files[r]))
    if b.mesh:
        layout.mesh_shape, layout.mesh_dim_names = b.mesh
        layout.parallel = _mesh_parallel(b.mesh[0], b.mesh[1], b.kinds_by_dim())
    elif world > 1:
        layout.parallel = {"fsdp": world}
    all_keys = set().union(*b.keys_by_rank.values()) if b.keys_by_rank else set()
    for r, keys in sorted(b.keys_by_rank.items()):
        if keys != all_keys and not present_only:
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
    duplicates = _duplicate_ranks(layout, files, b.copies, b.coords)
    unreadable = duplicates or any(p.code in ("unreadable-file", "truncated-file",
                                              "unsafe-pickle", "unsupported-record")
                                   for p in layout.problems)
    replica_dims = [i for i, n in enumerate(layout.mesh_shape)
                    if b.kinds_by_dim().get(i) == {"Replicate"} and n > 1]
    # copies of one place on the ranks read (HSDP replicas, replicated buffers): the union's
    # judgement compares them (core/distributed.py), and so does --deep (core/deep.py)
    layout.replica_copies = b.copies
    if replica_dims and not unreadable and not present_only and not n_missing:
        _replicas_disagreeing(layout, b.copies, directories)  # (missing: _serve_from_replicas)
    if present_only:  # for the union's judgement (core/distributed.py)
        layout.keys_by_rank = b.keys_by_rank  # the key check
        layout.kinds_by_dim = b.kinds_by_dim()  # which mesh dims only replicate (HSDP)
    elif n_missing and not unreadable and replica_dims and n_missing < world:
        _serve_from_replicas(layout, b, world, missing, replica_dims)
    elif not unreadable and not any(p.code == "missing-rank" for p in layout.problems):
        for t in layout.tensors.values():
            layout.problems.extend(coverage_problems(t))
    hf = root / "huggingface"
    attach_config(layout, hf if hf.is_dir() else None)
    return layout


def _preview(layout: CheckpointLayout, b: _Builder, root: Path) -> CheckpointLayout:
    """What the rank files read so far say, for a front end to show while the others are
    read (core/phases.py): a snapshot of ``layout`` with the mesh and parallel degrees as
    far as known and the config attached; nothing judged that needs every file."""
    snap = snapshot(layout)
    if b.mesh:
        snap.mesh_shape, snap.mesh_dim_names = b.mesh
        snap.parallel = _mesh_parallel(b.mesh[0], b.mesh[1], b.kinds_by_dim())
    elif snap.world_size > 1:
        snap.parallel = {"fsdp": snap.world_size}
    hf = root / "huggingface"
    try:
        attach_config(snap, hf if hf.is_dir() else None)
        from ..native_names import convert  # torchtitan/torchtune names -> HF, as detect does

        convert(snap)
        snap.problems = [p for p in snap.problems if p.code not in (
            "native-names-no-config", "unmapped-tensor", "config-mismatch", "shape-mismatch")]
    except Exception:  # noqa: BLE001 - a preview; the full read records what is wrong
        pass
    return snap
