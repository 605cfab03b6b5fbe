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
