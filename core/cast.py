"""Floating-point casts between F32, F16 and BF16 on raw bytes with numpy, bit-identical to
torch's ``Tensor.to`` on the CPU, for pieces assembled in memory (strided pieces, boxes of TP
columns) without importing torch. A merge casts contiguous pieces with torch itself
(core/execute.py ``_cast_range``: torch is imported by the architecture check anyway, and its
vectorised conversion is several times faster than these numpy steps).

Rules (c10/util/BFloat16.h ``round_to_nearest_even``; IEEE 754 for F16): F32 -> BF16 keeps the
upper 16 bits after adding ``0x7FFF + lsb`` (round to nearest, ties to even); F16 <-> F32 use
numpy's IEEE conversions; BF16 -> F32 is exact (a shift); other pairs go through F32, as torch
does. Every non-NaN value gets torch's bits. NaN stays NaN, but its bits are a convention:
torch itself gives ``0xFFFF`` from its vectorised F32 -> BF16 loop and ``0x7FC0`` from the
scalar tail of the same call; we write ``0x7FC0``, and quiet F16 NaNs as torch does.
``tests/test_cast.py`` checks this against torch on special and random values.
"""

from __future__ import annotations

import numpy as np

SUPPORTED = frozenset({"F32", "F16", "BF16"})


#: elements cast per step: the scratch arrays (4 bytes an element) stay in the CPU cache,
#: and no temporary is as large as the tensor
CHUNK = 1 << 16


def _to_f32(raw: np.ndarray, src: str, scratch: np.ndarray) -> np.ndarray:
    """``raw`` (bytes of ``src`` elements) as float32: a view for F32, else written into
    ``scratch`` (float32, at least as long)."""
    if src == "F32":
        return raw.view(np.float32)
    x = scratch[: len(raw) // ITEM[src]]
    if src == "F16":
        np.copyto(x, raw.view(np.float16))
    else:  # BF16: the upper half of a float32
        u = x.view(np.uint32)
        np.copyto(u, raw.view(np.uint16))
        u <<= 16
    return x


def _from_f32(x: np.ndarray, dst: str, out: np.ndarray, tmp: np.ndarray,
              nan: np.ndarray) -> None:
    """Write float32 ``x`` into ``out`` (``dst`` elements as unsigned ints of their width)
    with torch's rounding; ``tmp`` (uint32) and ``nan`` (bool) are scratch."""
    n = len(x)
    if dst == "F32":
        np.copyto(out.view(np.float32), x)
        return
    isnan = nan[:n]
    np.not_equal(x, x, out=isnan)
    if dst == "F16":
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(out.view(np.float16), x, casting="unsafe")
        if isnan.any():
            out[isnan] |= 0x0200  # a quiet NaN, as torch's conversion makes it
        return
    u, t = x.view(np.uint32), tmp[:n]  # BF16: round to nearest even on the upper half
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    t += 0x7FFF
    t += u
    t >>= 16
    np.copyto(out, t, casting="unsafe")
    if isnan.any():
        out[isnan] = 0x7FC0


ITEM = {"F32": 4, "F16": 2, "BF16": 2}
_UINT = {"F32": np.uint32, "F16": np.uint16, "BF16": np.uint16}


def cast_bytes(data, src: str, dst: str) -> np.ndarray:
    """``data`` (bytes-like, ``src`` elements) cast to ``dst``; returns a numpy array of the
    output bytes' element type (unsigned ints of the output width; ``data`` itself as bytes
    when ``src == dst``). Works :data:`CHUNK` elements at a time, so the only large
    allocation is the output. Raises KeyError for a pair outside :data:`SUPPORTED`."""
    if src not in SUPPORTED or dst not in SUPPORTED:
        raise KeyError((src, dst))
    raw = np.frombuffer(data, dtype=np.uint8)
    if src == dst:
        return raw
    n = len(raw) // ITEM[src]
    out = np.empty(n, dtype=_UINT[dst])
    size = min(CHUNK, n)
    f32, tmp, nan = (np.empty(size, np.float32), np.empty(size, np.uint32),
                     np.empty(size, bool))
    step = CHUNK * ITEM[src]
    for i in range(0, n, CHUNK):
        chunk = raw[i * ITEM[src]:i * ITEM[src] + step]
        _from_f32(_to_f32(chunk, src, f32), dst, out[i:i + CHUNK], tmp, nan)
    return out


#: each float type: (its bits without the sign, the bits of +Inf, the sign bit); a value's
#: bits ``b`` are ±Inf when ``b & mask == inf``, Inf or NaN when ``b & mask >= inf``
_INF = {"F16": (0x7FFF, 0x7C00, 0x8000), "BF16": (0x7FFF, 0x7F80, 0x8000),
        "F32": (0x7FFFFFFF, 0x7F800000, 0x80000000),
        "F64": (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, 0x8000000000000000)}
_WORD = {"F16": np.uint16, "BF16": np.uint16, "F32": np.uint32, "F64": np.uint64}
_SIGNED = {np.uint16: np.int16, np.uint32: np.int32, np.uint64: np.int64}
#: how far each type reaches: a cast to a type of a lower rank can overflow (F32 -> BF16 too:
#: values within half a BF16 step of F32's largest round up to Inf)
_RANGE = {"F16": 0, "BF16": 1, "F32": 2, "F64": 3}


def can_overflow(src: str, dst: str) -> bool:
    """True when casting ``src`` elements to ``dst`` may turn finite values into ±Inf."""
    return src in _RANGE and dst in _RANGE and _RANGE[dst] < _RANGE[src]


def count_inf(raw: np.ndarray, dtype: str) -> int:
    """How many elements of ``raw`` (the bytes, or unsigned ints as wide as the elements, of
    ``dtype``: F16, BF16, F32 or F64) are +Inf or -Inf. Two max reductions over the words (no
    temporary array) tell a chunk without Inf or NaN, the usual case; only a chunk holding
    some is counted element by element."""
    mask, inf, sign = _INF[dtype]
    u = raw.reshape(-1).view(_WORD[dtype])
    if not len(u):
        return 0
    # as signed ints +Inf/+NaN are the largest positive words; as unsigned ints -Inf/-NaN
    # are the largest of all (the sign bit set, then the exponent's bits all set)
    if u.view(_SIGNED[_WORD[dtype]]).max() < inf and u.max() < (sign | inf):
        return 0
    return int(np.count_nonzero((u & mask) == inf))


def overflowed(src_raw, src: str, out_raw, dst: str) -> int:
    """Elements finite in ``src_raw`` (``src`` elements) and ±Inf in ``out_raw``, its cast to
    ``dst`` (the same elements in the same order; both bytes-like or numpy words): a cast
    keeps Inf as Inf and NaN as NaN, so this is the Inf count of the output less that of the
    source. 0 when the cast cannot overflow (:func:`can_overflow`)."""
    if not can_overflow(src, dst):
        return 0
    out_raw = out_raw if isinstance(out_raw, np.ndarray) else np.frombuffer(out_raw, np.uint8)
    n = count_inf(out_raw, dst)
    if n:
        src_raw = (src_raw if isinstance(src_raw, np.ndarray)
                   else np.frombuffer(src_raw, np.uint8))
        n -= count_inf(src_raw, src)
    return n
