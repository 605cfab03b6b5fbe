"""Reading a safetensors header: tensor names, dtypes, shapes and byte offsets.

Format facts (the safetensors spec): 8-byte little-endian header length N, N bytes of JSON
mapping each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the end of the header) plus an optional ``__metadata__`` dict of strings, then the data.
Our own parser rather than ``safe_open``: the streaming merge needs each tensor's absolute byte
offset, and a damaged header must become a reported problem, not an exception from Rust.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from ..dtypes import ITEMSIZE
from ..errors import BadCheckpointError

MAX_HEADER = 100_000_000  # the spec's limit on the JSON header


@dataclass
class SafetensorsEntry:
    """One tensor of a safetensors file: absolute byte offset of its data, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    byte_offset: int
    nbytes: int


def read_header(path: str) -> tuple[list[SafetensorsEntry], dict[str, str]]:
    """Entries (in file order) and ``__metadata__`` of a safetensors file. Raises
    :class:`BadCheckpointError` when the header is invalid or an offset passes the file's end."""
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadCheckpointError("safetensors file shorter than its 8-byte header "
                                         "length: truncated", path)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise BadCheckpointError(f"safetensors header length {n} passes the end of the "
                                         f"{size}-byte file: truncated or corrupt", path)
            raw = f.read(n)
    except OSError as e:
        raise BadCheckpointError(f"cannot read: {e.strerror}", path) from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadCheckpointError("safetensors header is not valid JSON", path) from None
    if not isinstance(header, dict):
        raise BadCheckpointError("safetensors header is not a JSON object", path)
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    entries = []
    for name, e in header.items():
        try:
            dtype, shape = e["dtype"], tuple(int(s) for s in e["shape"])
            begin, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BadCheckpointError(f"{name}: malformed header entry", path) from None
        if any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise BadCheckpointError(f"{name}: negative shape or offsets in the header", path)
        if dtype in ("F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"):  # safetensors/torch.py _TYPES
            raise BadCheckpointError(f"{name}: dtype {dtype} is not supported (safetensors' "
                                     "torch loader cannot read it back)", path,
                                     code="unsupported-dtype")
        if dtype not in ITEMSIZE:
            raise BadCheckpointError(f"{name}: unknown dtype {dtype}", path)
        if end - begin != math.prod(shape) * ITEMSIZE[dtype] or begin < 0:
            raise BadCheckpointError(f"{name}: data_offsets [{begin}, {end}] do not fit "
                                     f"{dtype}{list(shape)}", path)
        if base + end > size:
            raise BadCheckpointError(f"{name}: data ends at byte {base + end} but the file has "
                                     f"{size}: truncated", path)
        entries.append(SafetensorsEntry(name, dtype, shape, base + begin, end - begin))
    entries.sort(key=lambda e: e.byte_offset)
    return entries, meta
