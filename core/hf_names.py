"""The names and tensors ``save_pretrained`` writes, from the names a model holds in memory.

Training frameworks save ``model.state_dict()``: the names and tensors of the model *in memory*.
transformers 5 keeps some models in memory in another form than on disk, and undoes it when it
saves (``PreTrainedModel.save_pretrained`` in transformers/modeling_utils.py):

- ``remove_tied_weights_from_state_dict`` drops the aliases of one tied tensor (T5's
  ``shared``/``encoder.embed_tokens``/``decoder.embed_tokens``/``lm_head``; a tied
  ``lm_head``), keeping the one ``from_pretrained`` expects;
- ``revert_weight_conversion`` (transformers/core_model_loading.py) runs the model's weight
  conversions (transformers/conversion_mapping.py: ``WeightRenaming``, ``WeightConverter`` with
  ``Chunk``/``Concatenate``/``MergeModulelist``/``SplitModulelist``/``Transpose`` ops) in
  reverse: vision-language models' ``model.language_model.*`` become ``model.*`` and
  ``model.visual.*`` become ``visual.*`` (Qwen2-VL family), fused experts
  ``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` become ``mlp.experts.{e}.gate_proj.weight`` and
  ``up_proj.weight`` ``[F, H]`` per expert (Qwen2-MoE family, Mixtral's ``w1``/``w3``/``w2``).

This module runs transformers' own code for both steps — on the model the judge builds from
the config on the meta device (:func:`core.judge.meta_model`, one build per config and class
for the whole merge) and on meta tensors, so no weight is read — and records, with a
``TorchDispatchMode``, which element of which in-memory tensor each saved tensor holds: each
saved tensor is a union of *boxes*, each box a sub-box of one source tensor, its dims possibly
reordered (a transpose). :func:`cut` turns a box into pieces of the stored slices (same bytes,
moved offsets, permuted strides), so the merge still streams. An op whose result is not such a
box (a reshape that mixes dims, an interleave) is refused, naming the model and the op: never
a wrong tensor.

torch and transformers are imported inside functions: plain ``inspect`` never loads them.
What :func:`saved_mapping` learns from the model for a set of names, shapes and dtypes (the
:class:`SaveForm`) is kept on disk (:mod:`core.archcache`), so a later merge of the same
model plans without importing them at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .dtypes import ITEMSIZE
from .errors import BadCheckpointError
from .layout import Piece, TensorInfo


@dataclass(frozen=True)
class Box:
    """A block of a saved tensor taken from one in-memory tensor.

    ``offsets``/``shape``: where the block sits in the saved tensor and its extent (elements,
    one entry per saved dim). ``source``: the in-memory name. ``start``: the source element of
    the block's first element (one entry per source dim). ``dims``: for each saved dim, the
    source dim it runs along, or None for a new dim of size 1. Source dims no saved dim runs
    along are fixed at ``start``.
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    source: str
    start: tuple[int, ...]
    dims: tuple[int | None, ...]

    def is_whole(self, source_shape: tuple[int, ...]) -> bool:
        """True when the block is the whole source tensor, dims in order (a plain rename)."""
        return (self.dims == tuple(range(len(source_shape))) and self.shape == tuple(source_shape)
                and not any(self.start) and not any(self.offsets))


@dataclass
class SaveForm:
    """What ``save_pretrained`` writes for a set of in-memory tensors.

    ``tensors``: saved name -> (shape, boxes filling it). ``dropped``: in-memory names that
    are not written (tied aliases, ``_keys_to_ignore_on_save``). ``model``: the class name.
    """

    model: str
    tensors: dict[str, tuple[tuple[int, ...], list[Box]]]
    dropped: set[str]

    def renames(self) -> dict[str, str]:
        """in-memory name -> saved name for the tensors written whole under another name
        (or the same one); cut or joined tensors are left out."""
        return {boxes[0].source: name for name, (shape, boxes) in self.tensors.items()
                if len(boxes) == 1 and boxes[0].shape == shape and not any(boxes[0].offsets)
                and boxes[0].dims == tuple(range(len(shape)))}


class UnsupportedOp(Exception):
    """An op of a weight conversion whose result is not a box of its source."""


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _slice(boxes: list[Box], dim: int, lo: int, hi: int) -> list[Box]:
    """The boxes of ``x[..., lo:hi, ...]`` (along ``dim``), offsets counted from ``lo``."""
    out = []
    for b in boxes:
        o, n = b.offsets[dim], b.shape[dim]
        a, z = max(o, lo), min(o + n, hi)
        if a >= z:
            continue
        start = list(b.start)
        if b.dims[dim] is not None:
            start[b.dims[dim]] += a - o
        out.append(replace(b, offsets=b.offsets[:dim] + (a - lo,) + b.offsets[dim + 1:],
                           shape=b.shape[:dim] + (z - a,) + b.shape[dim + 1:],
                           start=tuple(start)))
    return out


def _drop(boxes: list[Box], dim: int) -> list[Box]:
    """Remove ``dim`` (of size 1 in every box) from the boxes."""
    return [replace(b, offsets=b.offsets[:dim] + b.offsets[dim + 1:],
                    shape=b.shape[:dim] + b.shape[dim + 1:], dims=b.dims[:dim] + b.dims[dim + 1:])
            for b in boxes]


def _insert(boxes: list[Box], dim: int) -> list[Box]:
    """Add a new dim of size 1 at ``dim``."""
    return [replace(b, offsets=b.offsets[:dim] + (0,) + b.offsets[dim:],
                    shape=b.shape[:dim] + (1,) + b.shape[dim:], dims=b.dims[:dim] + (None,)
                    + b.dims[dim:]) for b in boxes]


def _permute(boxes: list[Box], order: list[int]) -> list[Box]:
    return [replace(b, offsets=tuple(b.offsets[i] for i in order),
                    shape=tuple(b.shape[i] for i in order), dims=tuple(b.dims[i] for i in order))
            for b in boxes]


def _reshape(boxes: list[Box], old: tuple[int, ...], new: tuple[int, ...], op: str) -> list[Box]:
    """A view that only adds or removes dims of size 1; anything else mixes dims."""
    if [s for s in old if s != 1] != [s for s in new if s != 1]:
        raise UnsupportedOp(f"{op} {list(old)} -> {list(new)}")
    for i in reversed([i for i, s in enumerate(old) if s == 1]):
        boxes = _drop(boxes, i)
    for i, s in enumerate(new):
        if s == 1:
            boxes = _insert(boxes, i)
    return boxes


def _tracker():
    """A ``TorchDispatchMode`` that follows each tracked meta tensor as a list of :class:`Box`
    through the view, copy and join ops weight conversions use."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    copies = {aten.clone.default, aten.detach.default, aten.alias.default,
              aten.lift_fresh.default, aten._to_copy.default, aten.contiguous.default}

    class Tracker(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.boxes: dict[int, tuple] = {}  # id -> (tensor kept alive, boxes)

        def track(self, t, boxes):
            self.boxes[id(t)] = (t, boxes)

        def get(self, t):
            hit = self.boxes.get(id(t)) if isinstance(t, torch.Tensor) else None
            return None if hit is None or hit[0] is not t else hit[1]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = args[0] if args and isinstance(args[0], (list, tuple)) else args[:1]
            srcs = [self.get(t) for t in inputs]
            if not any(s is not None for s in srcs):
                return out
            if any(s is None for s in srcs):
                raise UnsupportedOp(f"{func} joins a weight with an untracked tensor")
            x = args[0]
            nd = x.dim() if isinstance(x, torch.Tensor) else None
            res = self._apply(func, args, kwargs, srcs, nd, out)
            if isinstance(out, (list, tuple)):
                for t, b in zip(out, res):
                    self.track(t, b)
            else:
                self.track(out, res)
            return out

        def _apply(self, func, args, kwargs, srcs, nd, out):
            b = srcs[0]
            x = args[0]
            pack = func.overloadpacket
            if func in copies:
                if func is aten._to_copy.default and kwargs.get("dtype") not in (None, x.dtype):
                    raise UnsupportedOp(f"{func} to {kwargs['dtype']}")
                return b
            if pack is aten.slice:
                dim = _norm(args[1] if len(args) > 1 else kwargs.get("dim", 0), nd)
                size = x.shape[dim]
                lo = args[2] if len(args) > 2 else kwargs.get("start")
                hi = args[3] if len(args) > 3 else kwargs.get("end")
                step = args[4] if len(args) > 4 else kwargs.get("step", 1)
                if step != 1:
                    raise UnsupportedOp(f"{func} with step {step}")
                lo, hi, _ = slice(lo, hi).indices(size)
                return _slice(b, dim, lo, max(lo, hi))
            if func in (aten.split.Tensor, aten.split_with_sizes.default,
                        aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default):
                dim = _norm(args[2] if len(args) > 2 else kwargs.get("dim", 0), nd)
                res, pos = [], 0
                for t in out:
                    res.append(_slice(b, dim, pos, pos + t.shape[dim]))
                    pos += t.shape[dim]
                return res
            if func is aten.select.int:
                dim, i = _norm(args[1], nd), args[2]
                i = i + x.shape[dim] if i < 0 else i
                return _drop(_slice(b, dim, i, i + 1), dim)
            if func is aten.unbind.int:
                dim = _norm(args[1] if len(args) > 1 else kwargs.get("dim", 0), nd)
                return [_drop(_slice(b, dim, i, i + 1), dim) for i in range(x.shape[dim])]
            if func is aten.transpose.int:
                d0, d1 = _norm(args[1], nd), _norm(args[2], nd)
                order = list(range(nd))
                order[d0], order[d1] = order[d1], order[d0]
                return _permute(b, order)
            if func is aten.t.default:
                return _permute(b, list(range(nd))[::-1])
            if func is aten.permute.default:
                return _permute(b, [_norm(d, nd) for d in args[1]])
            if pack in (aten.squeeze, aten.unsqueeze, aten.view, aten._unsafe_view,
                        aten.reshape):
                return _reshape(b, tuple(x.shape), tuple(out.shape), str(func))
            if func is aten.cat.default:
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                dim = _norm(dim, out.dim())
                res, pos = [], 0
                for t, bb in zip(args[0], srcs):
                    res += [replace(q, offsets=q.offsets[:dim] + (q.offsets[dim] + pos,)
                                    + q.offsets[dim + 1:]) for q in bb]
                    pos += t.shape[dim]
                return res
            if func is aten.stack.default:
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                dim = _norm(dim, out.dim())
                res = []
                for i, bb in enumerate(srcs):
                    res += [replace(q, offsets=q.offsets[:dim] + (i,) + q.offsets[dim + 1:])
                            for q in _insert(bb, dim)]
                return res
            raise UnsupportedOp(str(func))

    return Tracker()


def save_form(model, tensors: dict[str, tuple[tuple[int, ...], str]]) -> SaveForm:
    """What ``model.save_pretrained`` writes for the in-memory ``tensors`` (name -> (shape,
    safetensors dtype)), following transformers' own save path: ``_keys_to_ignore_on_save``,
    ``remove_tied_weights_from_state_dict`` (tied aliases by the model's own parameters),
    ``revert_weight_conversion``. Only names of ``model.state_dict()`` take part; pass the
    others through yourself. Raises :class:`BadCheckpointError` when a conversion op is not a
    box of its source (names the model and the op) or transformers fails on the names."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from .dtypes import torch_dtype

    name = type(model).__name__
    own = model.state_dict()
    sd = {n: torch.empty(shape, dtype=torch_dtype(dt), device="meta")
          for n, (shape, dt) in tensors.items() if n in own}
    kept = dict(sd)
    for key in model._keys_to_ignore_on_save or ():
        kept.pop(key, None)
    kept = remove_tied_weights_from_state_dict(kept, model)
    tracker = _tracker()
    for n, t in kept.items():
        tracker.track(t, [Box((0,) * t.dim(), tuple(t.shape), n, (0,) * t.dim(),
                              tuple(range(t.dim())))])
    try:
        with tracker:
            saved = revert_weight_conversion(model, kept)
    except UnsupportedOp as e:
        raise BadCheckpointError(f"{name}: save_pretrained's weight conversion uses {e}, which "
                                 "shardscope cannot express as slices of the stored tensors")
    except Exception as e:  # noqa: BLE001 - transformers' own error on these names
        raise BadCheckpointError(f"{name}: transformers' weight conversion fails on these "
                                 f"tensors ({type(e).__name__}: {e})") from None
    out: dict[str, tuple[tuple[int, ...], list[Box]]] = {}
    for n, t in saved.items():
        boxes = tracker.get(t)
        if boxes is None:
            raise BadCheckpointError(f"{name}: save_pretrained writes {n} from a tensor "
                                     "shardscope cannot trace to the checkpoint's tensors")
        out[n] = (tuple(t.shape), boxes)
    return SaveForm(name, out, set(sd) - set(kept))


def _run(shape: tuple[int, ...], lo: list[int], hi: list[int]) -> tuple[int, int] | None:
    """(first element, count) of the box ``[lo, hi)`` of a C-contiguous tensor of ``shape``
    when the box is one run of consecutive elements (leading dims of extent 1, then one
    partial dim, then whole dims), else None."""
    k = 0
    while k < len(shape) and hi[k] - lo[k] == 1:
        k += 1
    if any(lo[d] != 0 or hi[d] != shape[d] for d in range(k + 1, len(shape))):
        return None
    start, step = 0, 1
    for d in reversed(range(len(shape))):
        start += lo[d] * step
        step *= shape[d]
    count = 1
    for a, z in zip(lo, hi):
        count *= z - a
    return start, count


def _cut_flat(box: Box, source: TensorInfo, out_shape: tuple[int, ...]) -> list[Piece]:
    """:func:`cut` for a flat tensor (pieces are ranges of the flattened tensor, as DeepSpeed's
    ZeRO partitions): the box must be one run of consecutive elements in the source and in
    the saved tensor, dims in order (no transpose); the pieces are ranges of the saved
    tensor's flattened form."""
    order = [d for d in box.dims if d is not None]
    lo = list(box.start)
    hi = [a + 1 for a in box.start]
    for k, d in enumerate(box.dims):
        if d is not None:
            hi[d] = lo[d] + box.shape[k]
    src = _run(source.shape, lo, hi)
    dst = _run(out_shape, list(box.offsets), [o + n for o, n in zip(box.offsets, box.shape)])
    if order != sorted(order) or src is None or dst is None:
        raise BadCheckpointError(f"{source.name}: save_pretrained writes it cut across its "
                                 "rows or transposed, which shardscope does not do for flat "
                                 "(ZeRO) partitions yet")
    (start, count), (at, _) = src, dst
    size = ITEMSIZE[source.dtype]
    pieces = []
    for p in source.pieces:
        o, n = p.global_offsets[0], p.shape[0]
        a, z = max(o, start), min(o + n, start + count)
        if a < z:
            pieces.append(replace(p, byte_offset=p.byte_offset + (a - o) * p.stride[0] * size,
                                  shape=(z - a,), global_offsets=(at + a - start,)))
    return pieces


def cut(box: Box, source: TensorInfo, resolve=None, out_shape=None) -> list[Piece]:
    """The pieces of ``source`` (located with ``resolve`` when they are deferred) that fill
    ``box``, as pieces of the saved tensor (of ``out_shape``, default the box's): each one the
    intersection of a stored slice with the box, its byte offset moved to the first element,
    its shape and strides in the saved tensor's dim order (a transpose is a permutation of
    strides), its offsets in the saved tensor. For a flat source (ZeRO partitions) the pieces
    are ranges of the flattened saved tensor; a box that is not one run of consecutive
    elements there raises :class:`BadCheckpointError`."""
    if box.is_whole(source.shape):
        return list(source.pieces)
    if source.flat:
        return _cut_flat(box, source, tuple(out_shape or box.shape))
    size = ITEMSIZE[source.dtype]
    ranges = {}  # source dim -> (lo, hi) of the box
    for k, d in enumerate(box.dims):
        if d is not None:
            ranges[d] = (box.start[d], box.start[d] + box.shape[k])
    pieces = []
    for p in source.pieces:
        if resolve is not None and p.archive is not None:
            p = resolve(p)
        lo, hi = [], []
        for d, (go, sh) in enumerate(zip(p.global_offsets, p.shape)):
            a, z = ranges.get(d, (box.start[d], box.start[d] + 1))
            lo.append(max(go, a))
            hi.append(min(go + sh, z))
        if any(a >= z for a, z in zip(lo, hi)):
            continue
        off = sum((lo[d] - p.global_offsets[d]) * p.stride[d] for d in range(len(p.shape)))
        shape, stride, goff = [], [], []
        for k, d in enumerate(box.dims):
            if d is None:
                shape.append(1)
                stride.append(1)
                goff.append(box.offsets[k])
            else:
                shape.append(hi[d] - lo[d])
                stride.append(p.stride[d])
                goff.append(box.offsets[k] + lo[d] - box.start[d])
        pieces.append(replace(p, byte_offset=p.byte_offset + off * size, shape=tuple(shape),
                              stride=tuple(stride), global_offsets=tuple(goff)))
    return pieces


def saved_mapping(layout, mapping: dict[str, str], config_dir: str | None,
                  trust_remote_code: bool = False
                  ) -> tuple[dict[str, "str | TensorInfo"], dict[str, str]]:
    """The plan's ``mapping`` (output name -> source tensor name in ``layout``, output names
    being the model's in-memory names) rewritten to what ``save_pretrained`` writes: renamed
    entries keep their source name, tied aliases are dropped, and a tensor cut from (or joined
    of) stored tensors maps to a new :class:`TensorInfo` whose pieces are sub-boxes of the
    stored slices. Names the model does not hold in memory pass through unchanged. The model
    is the judge's (:func:`core.judge.meta_model`: the class the architecture check picks for
    these names, built once on the meta device, remote code only with ``trust_remote_code``);
    without a config or a model to build, ``mapping`` is returned as is.

    Returns (new mapping, saved name -> in-memory name for the renamed entries). Raises
    :class:`BadCheckpointError` when transformers' conversion cannot be written as slices, or
    a saved name collides with another output name.
    """
    if config_dir is None or not mapping:
        return mapping, {}
    form, memory = cached_form(layout, mapping, config_dir, trust_remote_code)
    if form is None:
        return mapping, {}
    return _wrapped(layout, mapping, form, memory)


def form_signature(layout, mapping: dict) -> list:
    """What :func:`saved_mapping`'s answer depends on besides the config: ``[name, shape,
    dtype]`` of every in-memory name of ``mapping`` (``[name, None]`` for one ``layout`` does
    not hold), sorted by name. JSON-able: core/archworker.py gets it from another process."""
    sig = []
    for n in sorted(mapping):
        t = layout.tensors.get(mapping[n]) if isinstance(mapping[n], str) else None
        sig.append([n, None] if t is None else [n, list(t.shape), t.dtype])
    return sig


def cached_form(layout, mapping: dict, config_dir: str, trust_remote_code: bool = False):
    """(SaveForm or None, in-memory tensors) for ``mapping``'s names: from the persistent cache
    (:mod:`core.archcache`, keyed by the config and :func:`form_signature`) when it has them,
    else traced on the judge's meta model (then stored). ``layout`` needs only ``tensors``
    (name -> an object with ``shape`` and ``dtype``) and ``path``."""
    from . import archcache

    ckey = archcache.config_key(config_dir, None, trust_remote_code)
    dkey = None
    if ckey:  # what the model says about these names, shapes and dtypes, when already known
        dkey = archcache.digest(ckey, "save_form", form_signature(layout, mapping))
        hit = _decode(archcache.load(dkey))
        if hit is not None and all(n in mapping for n in hit[0]):
            own, form = hit
            if form is None:
                return None, None
            return form, {n: (layout.tensors[mapping[n]].shape,
                              layout.tensors[mapping[n]].dtype) for n in own}
    form, memory = _form(layout, mapping, config_dir, trust_remote_code)
    if dkey:
        archcache.store(dkey, _encode(form, memory))
    return form, memory


def _form(layout, mapping, config_dir, trust_remote_code):
    """(SaveForm, in-memory tensors) of the judge's meta model for ``mapping``'s names, or
    (None, None) when there is no model or it holds none of them."""
    from .judge import meta_model

    model = meta_model(mapping, config_dir, trust_remote_code=trust_remote_code)
    if model is None:
        return None, None
    own = set(model.state_dict())
    memory = {n: (layout.tensors[s].shape, layout.tensors[s].dtype)
              for n, s in mapping.items() if n in own}
    if not memory:
        return None, None
    try:
        return save_form(model, memory), memory
    except BadCheckpointError as e:
        if e.path is None:
            raise BadCheckpointError(e.message, layout.path) from None
        raise


def _wrapped(layout, mapping, form, memory):
    try:
        return _saved_mapping(layout, mapping, form, memory)
    except BadCheckpointError as e:
        if e.path is None:
            raise BadCheckpointError(e.message, layout.path) from None
        raise


def _encode(form: SaveForm | None, memory) -> dict:
    """A :class:`SaveForm` (and the in-memory names it was made from) as JSON."""
    if form is None:
        return {"form": None}
    return {"memory": sorted(memory), "form": {
        "model": form.model, "dropped": sorted(form.dropped),
        "tensors": [[n, list(shape), [[list(b.offsets), list(b.shape), b.source, list(b.start),
                                       list(b.dims)] for b in boxes]]
                    for n, (shape, boxes) in form.tensors.items()]}}


def _decode(v) -> tuple[list[str], SaveForm | None] | None:
    """:func:`_encode`'s inverse: (in-memory names, SaveForm or None); None when ``v`` is not
    such an entry (a miss)."""
    def ints(x):
        return tuple(int(i) for i in x)

    try:
        f = v["form"]
        if f is None:
            return [], None
        tensors = {str(n): (ints(shape), [Box(ints(o), ints(sh), str(src), ints(st), tuple(
            None if d is None else int(d) for d in dims)) for o, sh, src, st, dims in boxes])
            for n, shape, boxes in f["tensors"]}
        return [str(n) for n in v["memory"]], SaveForm(str(f["model"]), tensors,
                                                        {str(n) for n in f["dropped"]})
    except (TypeError, KeyError, ValueError):
        return None


def _saved_mapping(layout, mapping, form: SaveForm, memory):
    out: dict = {n: s for n, s in mapping.items() if n not in memory}
    renamed: dict[str, str] = {}
    for name, (shape, boxes) in form.tensors.items():
        if name in out:
            raise BadCheckpointError(f"{form.model}: save_pretrained writes {name} from "
                                     f"{boxes[0].source}, and the checkpoint also holds "
                                     f"{name}", layout.path)
        srcs = [layout.tensors[mapping[b.source]] for b in boxes]
        if len(boxes) == 1 and boxes[0].is_whole(srcs[0].shape):
            out[name] = mapping[boxes[0].source]
            if name != boxes[0].source:
                renamed[name] = boxes[0].source
            continue
        dtypes = {s.dtype for s in srcs}
        if len(dtypes) > 1:
            raise BadCheckpointError(f"{form.model}: save_pretrained joins tensors of "
                                     f"different dtypes ({', '.join(sorted(dtypes))}) into "
                                     f"{name}", layout.path)
        what = ", ".join(dict.fromkeys(b.source for b in boxes))
        flat = {s.flat for s in srcs}
        if len(flat) > 1:
            raise BadCheckpointError(f"{form.model}: save_pretrained joins flat and unflat "
                                     f"tensors into {name}", layout.path)
        t = TensorInfo(name, shape, srcs[0].dtype, f"{srcs[0].placement}; cut from {what}",
                       flat=flat.pop(), source=what)
        for b, s in zip(boxes, srcs):
            t.pieces.extend(cut(b, s, layout.resolve_piece, shape))
        out[name] = t
    return out, renamed
