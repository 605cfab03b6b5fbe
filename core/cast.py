"""Floating-point casts between F32, F16 and BF16 on raw bytes with numpy, bit-identical to
torch's ``Tensor.to`` on the CPU, so a ``--dtype`` merge need not import torch (about 2 s).

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


def _to_f32(raw: np.ndarray, src: str) -> np.ndarray:
    if src == "F32":
        return raw.view(np.float32)
    if src == "F16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # BF16


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32)
    out = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def cast_bytes(data, src: str, dst: str) -> np.ndarray:
    """``data`` (bytes-like, ``src`` elements) cast to ``dst``; returns a numpy array of the
    output bytes' element type. Raises KeyError for a pair outside :data:`SUPPORTED`."""
    if src not in SUPPORTED or dst not in SUPPORTED:
        raise KeyError((src, dst))
    raw = np.frombuffer(data, dtype=np.uint8)
    if src == dst:
        return raw
    x = _to_f32(raw, src)
    if dst == "F32":
        return x
    if dst == "F16":
        with np.errstate(over="ignore", invalid="ignore"):
            out = x.astype(np.float16).view(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            out[nan] |= 0x0200  # a quiet NaN, as torch's conversion makes it
        return out
    return _f32_to_bf16(x)
