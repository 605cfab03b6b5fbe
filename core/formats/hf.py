"""Hugging Face model folders: ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file)."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo
from .common import attach_config, contained, problem_for, read_weight_map, stat_file
from .safetensors_file import read_header

INDEX = "model.safetensors.index.json"
#: a shard's file name as huggingface_hub's ``split_torch_state_dict_into_shards`` makes it
SHARD_RE = re.compile(r"model-\d+-of-\d+\.safetensors")


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def sniff(path: str) -> bool:
    """True when ``path`` holds ``model.safetensors`` or a safetensors index."""
    p = Path(path)
    return (p / "model.safetensors").is_file() or (p / INDEX).is_file()


def read(path: str) -> CheckpointLayout:
    """Layout of a Hugging Face folder; every tensor is one piece. Problems: shards named by
    the index but missing (``missing-file``), unreadable headers, keys in two shards
    (``duplicate-key``), index entries whose shard lacks them and shard files the index does
    not name (``index-mismatch``; their tensors are in the layout all the same)."""
    root = Path(path)
    layout = CheckpointLayout(format="hf", path=str(root), world_size=1)
    if (root / INDEX).is_file():
        weight_map, shards = read_weight_map(root, INDEX)
    else:
        weight_map, shards = None, ["model.safetensors"]
    # shard files (huggingface_hub's names) that the index leaves out: their tensors are
    # read too, so that the problem is the index's (from_pretrained would not load them),
    # not a tensor "missing" from the folder
    unnamed = ([] if weight_map is None else
               sorted(f.name for f in root.iterdir() if SHARD_RE.fullmatch(f.name)
                      and f.name not in shards and f.is_file()))
    for name in unnamed:
        contained(root, name, "a shard file (symbolic link)")
    seen: dict[str, str] = {}
    for name in shards + unnamed:
        fpath = str(root / name)
        sf = stat_file(fpath)
        layout.files.append(sf)
        if sf.status == "missing":
            layout.problems.append(Problem("missing-file", "shard named by the index is missing",
                                           fpath))
            continue
        try:
            entries, _ = read_header(fpath)
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, fpath))
            continue
        if name in unnamed:
            names = [e.name for e in entries]
            layout.problems.append(Problem("index-mismatch", (
                f"holds {len(names)} tensor{'s' if len(names) != 1 else ''} ("
                + ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
                + f"), but {INDEX} does not name this shard: from_pretrained does not load "
                "it"), fpath))
        for e in entries:
            if e.name in seen:
                layout.problems.append(Problem("duplicate-key", f"{e.name} is also in "
                                               f"{seen[e.name]}", fpath))
                continue
            seen[e.name] = name
            if weight_map is not None and weight_map.get(e.name) != name and name not in unnamed:
                where = weight_map.get(e.name)
                layout.problems.append(Problem("index-mismatch", f"{e.name} is in {name}, " + (
                    f"the index says {where}" if where is not None
                    else "the index does not name it"), fpath))
            t = TensorInfo(e.name, e.shape, e.dtype, "full")
            t.pieces.append(Piece(fpath, e.byte_offset, e.dtype, e.shape, _strides(e.shape),
                                  (0,) * len(e.shape), 0))
            layout.tensors[e.name] = t
    if weight_map is not None:
        unreadable = {f.path for f in layout.files if f.status == "unreadable"}
        for k, v in weight_map.items():
            # a shard that cannot be read (truncated) has its own problem: its tensors are
            # not "missing from it" as far as anyone knows
            if k not in seen and (root / v).is_file() and str(root / v) not in unreadable:
                layout.problems.append(Problem("index-mismatch", f"{k} is not in {v}",
                                               str(root / v)))
    attach_config(layout, root)
    return layout
