"""The data model every format reader produces: a :class:`CheckpointLayout`.

A layout answers, without reading tensor data, *for each tensor of the full model, which bytes
of which files hold which slice of it*. Shapes are in elements, offsets of files in bytes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import ITEMSIZE


@dataclass(frozen=True)
class Piece:
    """One stored slice of a global tensor.

    ``file``/``byte_offset``: where element 0 of the slice's storage view starts (bytes).
    ``shape``/``stride``: the stored slice, in elements (strides as torch reports them).
    ``global_offsets``: where the slice starts in the global tensor, one entry per dim.
    ``rank``/``coord``: the rank that wrote it and its coordinate in the device mesh.
    ``archive``: ``(start, length, chunk shape)`` of an embedded ``torch.save`` archive (a
    DCP chunk; bytes, bytes, elements) not yet located; ``byte_offset`` then counts from that
    archive's tensor data and ``stride`` assumes it is C-contiguous.
    ``CheckpointLayout.resolve_piece`` locates it.
    """

    file: str
    byte_offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    global_offsets: tuple[int, ...]
    rank: int | None = None
    coord: tuple[int, ...] | None = None
    archive: tuple | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    @property
    def contiguous(self) -> bool:
        """True when the slice's bytes are one C-contiguous run in its file."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass
class TensorInfo:
    """A global tensor: its name in the checkpoint, shape (elements), dtype and the pieces that
    hold it. ``placement`` describes how it was stored (e.g. ``Shard(0)``, ``Replicate()``,
    ``(Replicate(), Shard(0))``, ``ShardedTensor``, ``plain``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: str
    pieces: list[Piece] = field(default_factory=list)
    #: True when the pieces index the flattened tensor (1-D ranges of ``numel`` elements), as
    #: DeepSpeed's flat ZeRO partitions store it
    flat: bool = False
    #: where the tensor comes from when the reader renamed or cut it, e.g. the Megatron
    #: ``decoder.layers.3.self_attention.linear_qkv.weight`` a ``q_proj`` is cut from
    source: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """The shape the pieces' offsets refer to: ``(numel,)`` for a flat tensor."""
        return (self.numel,) if self.flat else self.shape

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass
class SourceFile:
    """A file of the checkpoint: path, size in bytes, status (``ok``/``missing``/``unreadable``)
    and the rank that wrote it when known."""

    path: str
    bytes: int
    status: str = "ok"
    rank: int | None = None


@dataclass
class Problem:
    """Something wrong with the input. ``code`` is a stable string tests and the UI key on
    (``missing-rank``, ``truncated-file``, ``world-size-mismatch``, ``coverage-gap``,
    ``coverage-overlap``, ``shape-mismatch``, ``no-config`` ...); ``severity`` is ``error``
    (a merge refuses) or ``warning``."""

    code: str
    message: str
    path: str | None = None
    severity: str = "error"


@dataclass
class CheckpointLayout:
    """Everything known about a checkpoint before any tensor byte is read.

    ``mesh_shape``/``mesh_dim_names``: the device mesh the tensors were placed on (``()`` when
    none). ``parallel``: degree of each kind of parallelism found (keys dp, fsdp, tp, pp, vpp, ep).
    ``extra_files``: files to copy unchanged into a merged folder (config, tokenizer, code),
    as (source path, name in the output). ``notes``: facts worth telling the user.
    """

    format: str
    path: str
    world_size: int
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] | None = None
    parallel: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: list[SourceFile] = field(default_factory=list)
    extra_files: list[tuple[str, str]] = field(default_factory=list)
    config_dir: str | None = None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: :class:`core.lora.LoraInfo` when the checkpoint holds LoRA adapters
    lora: Any = None
    #: turns a piece with an ``archive`` (not located yet, e.g. a DCP chunk) into a located
    #: one; set by readers that defer that work past inspection
    resolve_piece: Any = field(default=None, repr=False, compare=False)
    #: facts about the model and its parallel layout worth showing, in order (label -> text),
    #: e.g. Megatron's pipeline stages and padded vocabulary
    details: dict[str, str] = field(default_factory=dict)
    #: ``config.json`` fields derived from the checkpoint itself (Megatron's ``args``) for a
    #: merge that finds no config folder: ``{"model_type": ..., field: value}``
    derived_config: dict[str, Any] | None = None

    @property
    def mesh_text(self) -> str:
        """The device mesh as ``ddp=2 x fsdp=2`` (``?`` for unnamed dims), or ``none``."""
        if not self.mesh_shape:
            return "none"
        names = self.mesh_dim_names or ("?",) * len(self.mesh_shape)
        return " x ".join(f"{n}={s}" for n, s in zip(names, self.mesh_shape))

    @property
    def parameters(self) -> int:
        """Total elements over all tensors."""
        return sum(t.numel for t in self.tensors.values())

    @property
    def bytes(self) -> int:
        """Total bytes of the full (unsharded) tensors, in their stored dtypes."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def dtypes(self) -> dict[str, int]:
        """Tensor count per dtype."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + 1
        return dict(sorted(out.items()))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form printed by ``shardscope inspect --json``."""
        par = {k: self.parallel.get(k, 1) for k in ("dp", "fsdp", "tp", "pp", "ep")}
        if "vpp" in self.parallel:
            par["vpp"] = self.parallel["vpp"]
        return {
            "format": self.format,
            "path": self.path,
            "world_size": self.world_size,
            "mesh": {"shape": list(self.mesh_shape), "dim_names": list(self.mesh_dim_names)
                     if self.mesh_dim_names is not None else None},
            "parallel": par,
            "tensors": len(self.tensors),
            "parameters": self.parameters,
            "bytes": self.bytes,
            "dtypes": self.dtypes,
            "shards": [{"path": f.path, "bytes": f.bytes, "status": f.status, "rank": f.rank}
                       for f in self.files],
            "config_dir": self.config_dir,
            "extra_files": [name for _, name in self.extra_files],
            "problems": [{"code": p.code, "message": p.message, "path": p.path,
                          "severity": p.severity} for p in self.problems],
            "notes": list(self.notes),
            "details": dict(self.details),
            "lora": self.lora.to_dict() if hasattr(self.lora, "to_dict") else self.lora,
            "params": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                        "placement": t.placement, "pieces": len(t.pieces),
                        **({"source": t.source} if t.source else {})}
                       for t in self.tensors.values()],
        }


def coverage_problems(t: TensorInfo) -> list[Problem]:
    """Check that ``t``'s pieces tile its global shape exactly: no gap, no overlap, no piece
    outside the tensor. Returns ``coverage-gap``/``coverage-overlap``/``piece-out-of-bounds``
    problems (empty when sound).

    Called for every tensor when a layout is read and again when a merge is planned (tens of
    thousands of pieces for a many-rank checkpoint), so: the answer is remembered on ``t``
    with the very piece objects it was computed from (pieces are frozen; a list changed in
    any way, a new shape or name, is checked again); and the common case is a fast path:
    pieces that span every dim but the first (FSDP's ``Shard(0)``, row splits) are checked
    with tuple comparisons and one sort (adjacent pieces only), any other piece takes the
    general path (pairwise boxes when more than one dim is split). Same problems, same
    order."""
    pieces = tuple(t.pieces)
    memo = t.__dict__.get("_coverage")
    if memo is not None and memo[0] == (t.name, t.shape, t.flat) and len(memo[1]) == len(
            pieces) and all(map(operator.is_, memo[1], pieces)):
        return [replace(p) for p in memo[2]]  # fresh objects: callers may edit theirs
    problems = _coverage_problems(t)
    t.__dict__["_coverage"] = ((t.name, t.shape, t.flat), pieces,
                                tuple(replace(p) for p in problems))
    return problems


def _coverage_problems(t: TensorInfo) -> list[Problem]:
    problems: list[Problem] = []
    shape = t.piece_shape
    ndim = len(shape)
    rest, zeros = tuple(shape[1:]), (0,) * (ndim - 1)
    rest_numel = math.prod(rest)
    first = shape[0] if ndim else 0
    rows = ndim > 0  # every non-empty piece spans dims 1.. whole (only dim 0 may be split)
    sized = []  # (global offsets, shape, numel, piece) of the non-empty pieces
    for p in t.pieces:
        offs, ps = p.global_offsets, p.shape
        if ndim and ps[1:] == rest and offs[1:] == zeros and len(ps) == ndim \
                and len(offs) == ndim:
            o, s = offs[0], ps[0]
            bad = o < 0 or o + s > first
            n = s * rest_numel
        elif len(ps) != ndim:
            bad = True
        else:
            bad = False
            for o, s, g in zip(offs, ps, shape):
                if o < 0 or o + s > g:
                    bad = True
                    break
            n = math.prod(ps)
            if n and not bad:
                rows = False
        if bad:
            problems.append(Problem("piece-out-of-bounds",
                                    f"{t.name}: piece {p.shape} at {p.global_offsets} lies outside "
                                    f"the global shape {shape}", p.file))
        elif not problems and n:
            sized.append((offs, ps, n, p))
    if problems:
        return problems
    total = sum(x[2] for x in sized)
    # Overlap: compare boxes pairwise; pieces sorted by offset so a 1-D split is checked in
    # linear time (only neighbours can overlap when every piece spans the other dims fully).
    sized.sort(key=lambda x: x[0])
    pieces = [x[3] for x in sized]
    if rows:  # split along dim 0 at most: a neighbour overlaps when it starts before the end
        for (ao, asz, _, a), (bo, _, _, b) in zip(sized, sized[1:]):
            if bo[0] < ao[0] + asz[0]:
                problems.append(Problem("coverage-overlap",
                                        f"{t.name}: pieces at {a.global_offsets} and "
                                        f"{b.global_offsets} overlap", b.file))
                return problems
        pairs = ()
    else:
        split_dims = {d for _, ps, _, _ in sized for d, (s, g) in enumerate(zip(ps, shape))
                      if s != g}
        if len(split_dims) <= 1:
            pairs = zip(pieces, pieces[1:])
        else:
            pairs = ((a, b) for i, a in enumerate(pieces) for b in pieces[i + 1:])
    for a, b in pairs:
        if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
               zip(a.global_offsets, a.shape, b.global_offsets, b.shape)):
            problems.append(Problem("coverage-overlap",
                                    f"{t.name}: pieces at {a.global_offsets} and {b.global_offsets} "
                                    "overlap", b.file))
            return problems
    if total != t.numel:
        problems.append(Problem("coverage-gap", f"{t.name}: pieces hold {total} of {t.numel} "
                                                "elements", t.pieces[0].file if t.pieces else None))
    return problems
