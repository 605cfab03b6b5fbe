"""Compare two checkpoints of any formats shardscope reads, tensor by tensor (``shardscope
diff A B``).

Each side is read as the merge would write it: :func:`core.plan.plan_merge` (without writing)
gives the Hugging Face names ``save_pretrained`` writes and, for each, its located pieces (and
LoRA fold), so a Megatron run compares ``q_proj`` with a Hugging Face folder's ``q_proj``, and a
sharded FSDP run compares with its merged output. Values are read by :mod:`core.read`, one
tensor of each side at a time (memory: two tensors plus a bounded float64 chunk). Same-dtype
tensors are compared as raw bit patterns first (numpy arrays of the stored words, no
decoding); only tensors that differ are decoded (torch) for statistics. (Planning the names
builds the model on the meta device with transformers, as a merge does.)
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

from .errors import BadCheckpointError, MergeCancelled
from .plan import ADAPTER_DIR, MergeOptions, natural_key

#: elements per float64 chunk when computing statistics (bounds the extra memory: 8 MiB x 4)
CHUNK = 1 << 20

#: statuses of a :class:`TensorDiff`
STATUSES = ("identical", "close", "changed", "dtype", "shape", "only_a", "only_b")

_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks|block)\.\d+)\.")


@dataclass
class SideOptions:
    """How to read one side, as ``merge`` would: ``hf_config`` (a Hugging Face config folder,
    used where the side has none of its own or has Megatron/native names), ``weights``
    (DeepSpeed ``master`` or ``module``), and the LoRA choice (``lora``: ``fold`` or ``base``,
    with ``lora_adapter``/``lora_alpha``/``lora_config``/``base_model`` as for ``merge``), used
    only by a side that holds an adapter. ``dtype``: ``bf16``/``fp16``/``fp32`` casts the
    side's floating tensors as ``merge --dtype`` does (e.g. a bf16 merge's source)."""

    hf_config: str | None = None
    dtype: str | None = None
    weights: str = "master"
    lora: str | None = None
    lora_adapter: str | None = None
    lora_alpha: float | None = None
    lora_config: str | None = None
    base_model: str | None = None


@dataclass
class TensorDiff:
    """One tensor name and how the two sides differ.

    ``status``: ``identical`` (bit for bit), ``close`` (within atol/rtol, whatever the dtypes:
    values compared in float64, as ``verify --atol``), ``changed``, ``dtype`` (dtypes differ
    and the values are not within a tolerance; compared in float64), ``shape`` (shapes differ; values not
    compared), ``only_a``/``only_b``. Statistics (float64, None when not computed or not
    finite): ``max_abs`` = max |B-A|, ``rel_change`` = ||B-A|| / ||A|| (Frobenius norms),
    ``cosine`` = <A,B> / (||A|| ||B||), ``differing`` = elements not equal (not within
    atol/rtol), ``norm_a``/``norm_diff`` = ||A||, ||B-A|| (for per-layer sums).

    NaN and Inf (counted when the values were decoded: ``nan_a``/``nan_b``/``inf_a``/
    ``inf_b``): ``nan_mismatch`` = elements NaN on one side only, ``inf_mismatch`` = elements
    +-Inf on one side only (or of the other sign), NaN aside. When either is not 0,
    ``max_abs``, ``rel_change``, ``cosine`` and ``norm_diff`` are NaN: a difference with
    NaN/Inf in it has no size, and the statistics of the finite rest would read as the whole
    change (:attr:`nonfinite` says what changed)."""

    name: str
    status: str
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    max_abs: float | None = None
    rel_change: float | None = None
    cosine: float | None = None
    differing: int | None = None
    norm_a: float | None = None
    norm_diff: float | None = None
    nan_mismatch: int = 0
    inf_mismatch: int = 0
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0

    @property
    def same(self) -> bool:
        return self.status in ("identical", "close")

    @property
    def nonfinite(self) -> str:
        """How NaN/Inf differ between the sides, short (``+1 NaN``, ``-2 Inf``, ``3 NaN
        moved``), or '' when they do not."""
        parts = []
        for kind, a, b, moved in (("NaN", self.nan_a, self.nan_b, self.nan_mismatch),
                                  ("Inf", self.inf_a, self.inf_b, self.inf_mismatch)):
            if a != b:
                parts.append(f"{b - a:+d} {kind}")
            elif moved:
                parts.append(f"{moved} {kind} moved")
        return ", ".join(parts)

    @property
    def layer(self) -> str:
        """The layer the tensor belongs to (``model.layers.3``), else ``(other)``."""
        m = _LAYER.match(self.name)
        return m.group(1) if m else "(other)"

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("shape_a", "shape_b"):
            d[k] = list(d[k]) if d[k] is not None else None
        for k in ("max_abs", "rel_change", "cosine", "norm_a", "norm_diff"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = "nan" if math.isnan(d[k]) else str(d[k])
        d["nonfinite"] = self.nonfinite or None
        return d


@dataclass
class LayerChange:
    """The tensors of one layer: how many, how many not identical, and the relative change of
    the layer as a whole, sqrt(sum ||B-A||^2) / sqrt(sum ||A||^2) over its compared tensors
    (NaN when one of them gained or lost NaN/Inf: ``nonfinite`` counts those tensors)."""

    layer: str
    tensors: int
    changed: int
    rel_change: float | None
    nonfinite: int = 0


@dataclass
class DiffResult:
    """The comparison of ``a`` and ``b`` (paths, formats), one :class:`TensorDiff` per name
    (natural order), with the tolerances used. ``same``: every name on both sides and every
    tensor identical (or close within atol/rtol)."""

    a: str
    b: str
    format_a: str
    format_b: str
    tensors: list[TensorDiff]
    atol: float = 0.0
    rtol: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return all(t.same for t in self.tensors)

    def same_text(self) -> str:
        """The verdict of a :attr:`same` result, worded as the counts are: ``identical bit
        for bit`` when every tensor is, else ``close within atol=A rtol=R`` and how many
        tensors are close and how many identical."""
        c = self.counts()
        if not c["close"]:
            return f"identical bit for bit: every one of the {len(self.tensors)} tensors"
        return (f"close within atol={self.atol:g} rtol={self.rtol:g}: every one of the "
                f"{len(self.tensors)} tensors ({c['close']} close, {c['identical']} "
                "identical bit for bit)")

    def counts(self) -> dict[str, int]:
        """Tensors per status (every status present, zero included)."""
        out = {s: 0 for s in STATUSES}
        for t in self.tensors:
            out[t.status] += 1
        return out

    def largest(self, n: int = 10) -> list[TensorDiff]:
        """The ``n`` compared tensors with the largest relative change (then max abs diff)."""
        moved = [t for t in self.tensors if t.status in ("changed", "close", "dtype")
                 and t.differing]
        # NaN/Inf that appeared or went first: their change has no size, and is the largest
        return sorted(moved, key=lambda t: (bool(t.nonfinite), _num(t.rel_change),
                                            _num(t.max_abs)), reverse=True)[:n]

    def by_layer(self) -> list[LayerChange]:
        """Per layer (``model.layers.N``, ``(other)`` last), in natural order."""
        groups: dict[str, list[TensorDiff]] = {}
        for t in self.tensors:
            groups.setdefault(t.layer, []).append(t)
        out = []
        for layer in sorted(groups, key=lambda k: (k == "(other)", natural_key(k))):
            ts = groups[layer]
            comp = [t for t in ts if t.norm_a is not None and t.norm_diff is not None]
            na = math.sqrt(sum(t.norm_a ** 2 for t in comp))
            nd = math.sqrt(sum(t.norm_diff ** 2 for t in comp))
            rel = (nd / na if na else (0.0 if nd == 0 else math.inf)) if comp else None
            if any(t.nonfinite for t in comp):
                rel = math.nan  # NaN/Inf appeared or went: no size, never 0
            out.append(LayerChange(layer, len(ts), sum(not t.status == "identical"
                                                       for t in ts), rel,
                                   sum(bool(t.nonfinite) for t in ts)))
        return out

    def to_dict(self, top: int = 10) -> dict:
        """The ``diff --json`` document; ``largest`` names at most ``top`` tensors."""
        return {"a": self.a, "b": self.b, "format_a": self.format_a, "format_b": self.format_b,
                "atol": self.atol, "rtol": self.rtol, "same": self.same,
                "counts": self.counts(), "warnings": self.warnings,
                "largest": [t.name for t in self.largest(top)],
                "layers": [{**asdict(lc), "rel_change": _json_num(lc.rel_change)}
                           for lc in self.by_layer()],
                "tensors": [t.to_dict() for t in self.tensors]}


def _num(x: float | None) -> float:
    return -1.0 if x is None or math.isnan(x) else x


def _json_num(x):
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else str(x)


def output_tensors(path: str, side: SideOptions | None = None):
    """(layout, warnings, {output name: :class:`core.plan.OutputTensor`}) of the checkpoint at
    ``path``: the tensors ``merge`` would write (names as ``save_pretrained`` writes them,
    located pieces, LoRA fold), planned without writing anything. Raises
    :class:`BadCheckpointError` for an unreadable or broken checkpoint, :class:`UsageError`
    when the side needs a choice (e.g. ``--lora``)."""
    plan = _plan_side(path, side)
    return plan.layout, list(plan.warnings), _side_tensors(plan)


def _plan_side(path: str, side: SideOptions | None):
    """The merge plan (not written) of one side, for :func:`output_tensors`."""
    from .formats import detect
    from .native_names import DETAIL as NATIVE
    from .plan import plan_merge

    side = side or SideOptions()
    layout = detect(path, deepspeed_weights=side.weights)
    native = NATIVE in layout.details or any(p.code == "native-names-no-config"
                                             for p in layout.problems)
    hf_config = None
    if side.hf_config and (layout.config_dir is None or native
                           or layout.format.startswith("megatron")):
        hf_config = side.hf_config
        if layout.format.startswith("megatron") or native:
            layout = detect(path, deepspeed_weights=side.weights, hf_config=hf_config)
    has_lora = layout.lora is not None and hasattr(layout.lora, "adapters")
    if has_lora and side.lora is None:
        from .errors import UsageError

        raise UsageError(f"holds LoRA ({layout.lora.summary()}): choose --lora fold (compare "
                         "the folded weights) or --lora base (the base weights alone)", path)
    # strict=False: a diff compares what each side holds; a side that does not match its
    # model class (a missing or reshaped tensor) is a difference to report, not a refusal
    opts = MergeOptions(output=str(path), hf_config=hf_config, model_card=False,
                        dtype=side.dtype, strict=False,
                        lora=side.lora if has_lora else None,
                        lora_adapter=side.lora_adapter if has_lora else None,
                        lora_alpha=side.lora_alpha if has_lora else None,
                        lora_config=side.lora_config if has_lora else None,
                        base_model=(side.base_model if has_lora and layout.lora.lora_only
                                    else None))
    return plan_merge(layout, opts, writing=False)


def _side_tensors(plan) -> dict:
    return {t.name: t for f in plan.files if not f.name.startswith(ADAPTER_DIR + "/")
            for t in f.tensors}


def diff_checkpoints(a: str, b: str, atol: float = 0.0, rtol: float = 0.0,
                     side_a: SideOptions | None = None, side_b: SideOptions | None = None,
                     on_progress: Callable[[int, int, str], None] | None = None,
                     cancel: threading.Event | None = None, crc: bool = True) -> DiffResult:
    """Compare checkpoint ``a`` with ``b`` (any formats, any pairing), tensor by tensor.

    ``atol``/``rtol``: tolerances (``|B-A| <= atol + rtol*|A|`` elementwise, as
    ``torch.isclose``; 0 and 0: bit for bit). ``on_progress(done, total, name)`` after each
    tensor; ``cancel`` is checked between tensors and raises :class:`MergeCancelled` (exit
    130). Raises :class:`BadCheckpointError`/:class:`UsageError` as :func:`output_tensors`.
    ``crc``: check the CRC-32 that ``torch.save`` records for every storage record read
    (as ``merge`` does, in a thread overlapping the comparison): a corrupt record is a
    :class:`BadCheckpointError` naming the file and the record, not a change.
    """
    pa = _plan_side(a, side_a)
    la, wa, ta = pa.layout, list(pa.warnings), _side_tensors(pa)
    if cancel is not None and cancel.is_set():  # planning a side builds its model: seconds
        raise MergeCancelled("diff cancelled")
    pb = _plan_side(b, side_b)
    lb, wb, tb = pb.layout, list(pb.warnings), _side_tensors(pb)
    checker = None
    if crc:
        from .integrity import plan_records, start_check

        checker = start_check(plan_records(pa)[0] + plan_records(pb)[0],
                              "not compared (--no-crc compares the bytes as they are)")
    warnings = [f"A: {w}" for w in wa if not w.startswith("no Hugging Face config")] + \
               [f"B: {w}" for w in wb if not w.startswith("no Hugging Face config")]
    from .read import Sources

    names = sorted(set(ta) | set(tb), key=natural_key)
    src_a, src_b = Sources(), Sources()
    out: list[TensorDiff] = []
    try:
        for i, name in enumerate(names):
            if cancel is not None and cancel.is_set():
                raise MergeCancelled("diff cancelled")
            if checker is not None and (checker.failed or checker.error):
                break  # refused below
            out.append(_compare(name, ta.get(name), tb.get(name), src_a, src_b, atol, rtol))
            if on_progress:
                on_progress(i + 1, len(names), name)
        if checker is not None:
            checker.result()  # raises for a record that fails its CRC-32
    finally:
        src_a.close()
        src_b.close()
        if checker is not None and checker.is_alive():
            checker.cancel.set()
            checker.join()
    kinds = sorted({(t.dtype_a, t.dtype_b) for t in out if t.status == "close"
                    and t.dtype_a != t.dtype_b})
    if kinds:  # a tolerance compares values, whatever their dtypes: say that they differ
        n = sum(t.status == "close" and t.dtype_a != t.dtype_b for t in out)
        warnings.append(f"{n} tensors are close within --atol/--rtol but stored in another "
                        f"dtype ({', '.join(f'{x} in A, {y} in B' for x, y in kinds)})")
    return DiffResult(str(a), str(b), la.format, lb.format, out, atol, rtol, warnings)


def _compare(name, x, y, src_a, src_b, atol, rtol) -> TensorDiff:
    """One name: ``x``/``y`` are the planned output tensors of A and B (or None)."""
    if x is None or y is None:
        return TensorDiff(name, "only_b" if x is None else "only_a",
                          tuple(x.shape) if x else None, tuple(y.shape) if y else None,
                          x.dtype if x else None, y.dtype if y else None)
    d = TensorDiff(name, "changed", tuple(x.shape), tuple(y.shape), x.dtype, y.dtype)
    if d.shape_a != d.shape_b:
        d.status = "shape"
        return d
    from .read import read_words

    if x.dtype == y.dtype and x.fold is None and y.fold is None:
        # raw bit patterns, not decoded: the common case (a merge against its source)
        import numpy as np

        wa = read_words(x.pieces, x.shape, x.source.dtype, src_a, x.source.flat)
        wb = read_words(y.pieces, y.shape, y.source.dtype, src_b, y.source.flat)
        if x.source.dtype == x.dtype and y.source.dtype == y.dtype and np.array_equal(wa, wb):
            d.status, d.max_abs, d.rel_change, d.differing, d.norm_diff = \
                "identical", 0.0, 0.0, 0, 0.0
            return _fill_norms_unchanged(d, wa, x.dtype)
        del wa, wb
    from .read import read_output_tensor

    va, vb = read_output_tensor(x, src_a), read_output_tensor(y, src_b)
    if va.dtype == vb.dtype:
        import torch

        if torch.equal(va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8)):
            d.status, d.max_abs, d.rel_change, d.differing, d.norm_diff = \
                "identical", 0.0, 0.0, 0, 0.0
            d.norm_a, d.cosine = _norm_cos_same(va)
            return d
    _stats(d, va, vb, atol, rtol)
    return d


def _fill_norms_unchanged(d: TensorDiff, words, dtype: str) -> TensorDiff:
    """An identical tensor's ||A|| (for the per-layer relative change), from its bit patterns
    with numpy in chunks (bf16 widened to float32 by its bits), without decoding the tensor
    through torch. Dtypes numpy cannot decode (float8, integers, bool) get
    no norm and are left out of the layer sums."""
    import numpy as np

    kinds = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
    flat = words.reshape(-1)
    s = 0.0
    for i in range(0, flat.size, CHUNK):
        c = flat[i:i + CHUNK]
        if dtype in kinds:
            c = c.view(kinds[dtype])
        elif dtype == "BF16":
            c = (c.astype(np.uint32) << 16).view(np.float32)
        else:
            return d
        c = c.astype(np.float64)
        s += float(np.dot(c, c))
    d.norm_a = math.sqrt(s)
    d.cosine = 1.0 if d.norm_a > 0 and math.isfinite(d.norm_a) else None
    return d


def _norm_cos_same(x) -> tuple[float, float | None]:
    s = 0.0
    flat = x.reshape(-1)
    for i in range(0, flat.numel(), CHUNK):
        c = flat[i:i + CHUNK].double()
        s += float((c * c).sum())
    n = math.sqrt(s)
    return n, (1.0 if n > 0 and math.isfinite(n) else None)


def _stats(d: TensorDiff, va, vb, atol: float, rtol: float) -> None:
    """Fill ``d``'s statistics from tensors ``va``/``vb`` (same shape), in float64 chunks:
    over the elements finite on both sides; NaN/Inf counted per side, and the size
    statistics NaN when they differ (see :class:`TensorDiff`)."""
    import torch

    fa, fb = va.reshape(-1), vb.reshape(-1)
    sa = sb = sab = sdd = 0.0
    mx = 0.0
    bad = nanm = infm = 0
    counts = [0, 0, 0, 0]  # NaN in A, in B, Inf in A, in B
    for i in range(0, fa.numel(), CHUNK):
        ca, cb = fa[i:i + CHUNK].double(), fb[i:i + CHUNK].double()
        na, nb = torch.isnan(ca), torch.isnan(cb)
        ia, ib = torch.isinf(ca), torch.isinf(cb)
        for j, m in enumerate((na, nb, ia, ib)):
            counts[j] += int(m.sum())
        nanm += int((na != nb).sum())
        infm += int(((ia | ib) & ~(na | nb) & (ca != cb)).sum())
        close = torch.isclose(ca, cb, rtol=rtol, atol=atol, equal_nan=True)
        bad += int((~close).sum())
        ok = torch.isfinite(ca) & torch.isfinite(cb)
        ca, cb = ca[ok], cb[ok]
        dd = cb - ca
        if dd.numel():
            mx = max(mx, float(dd.abs().max()))
        sa += float((ca * ca).sum())
        sb += float((cb * cb).sum())
        sab += float((ca * cb).sum())
        sdd += float((dd * dd).sum())
    d.max_abs, d.differing, d.nan_mismatch, d.inf_mismatch = mx, bad, nanm, infm
    d.nan_a, d.nan_b, d.inf_a, d.inf_b = counts
    d.norm_a, d.norm_diff = math.sqrt(sa), math.sqrt(sdd)
    d.rel_change = (d.norm_diff / d.norm_a if d.norm_a else
                    (0.0 if d.norm_diff == 0 else math.inf))
    d.cosine = sab / math.sqrt(sa * sb) if sa > 0 and sb > 0 else None
    if nanm or infm:  # not "changed by 0": the finite rest is not the change
        d.max_abs = d.rel_change = d.cosine = d.norm_diff = math.nan
    if bad == 0 and (atol or rtol):  # across dtypes too, as verify --atol compares values
        d.status = "close"
    elif d.dtype_a != d.dtype_b:
        d.status = "dtype"
    else:
        d.status = "changed"  # includes bits that differ between equal values (-0.0, 0.0)


def check_readable(path: str) -> None:
    """Raise :class:`UsageError` (exit 2, as inspect/merge/verify) when ``path`` does not
    exist (before any import)."""
    import os

    from .errors import UsageError

    if not os.path.exists(path):
        raise UsageError("no such file or folder", path)
